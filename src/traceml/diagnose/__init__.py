"""Diagnosis: pure rules over a window of rolled-up steps, producing ranked Findings.

The same functions give the live alerts and the final verdict. `diagnose` runs every rule,
tells each cause once (periodic slow steps that explain a share-based finding become that
finding's period), and ranks the findings so the first is the primary diagnosis:

1. an out-of-memory post-mortem;
2. memory that will run out (MEMORY_CREEP or MEMORY_PRESSURE at crit);
3. findings worth at least VERDICT_SHARE of their whole (`evidence.share`: what acting on the
   cause could win), the most run time first (a share of the step weighs as that share of the
   run's training), severity breaking ties. Evaluation and
   checkpoints count only above their own lines (they are the run's plan);
4. COMPUTE_BOUND, the verdict of a healthy run (given even below its own line when nothing
   above is found);
5. the rest, under "Also", by worth: among them stalls of the whole machine (another process
   took the CPU), so a run's verdict is the same on a busy machine as on a quiet one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from traceml.analysis.goodput import Goodput
from traceml.analysis.layer_rows import AliveLayer
from traceml.analysis.ledger import LedgerRow
from traceml.analysis.loaders import LoaderFigures
from traceml.analysis.rollup import RankRow, Window
from traceml.diagnose.captures import attach_captures
from traceml.diagnose.host_sync import host_sync
from traceml.diagnose.memory import MemoryLimits, memory_creep, memory_pressure, out_of_memory
from traceml.diagnose.run_time import recompilations, slow_startup
from traceml.diagnose.spikes import WARN_COST_SHARE, Stalls, periodic, planned_work, step_spikes
from traceml.diagnose.step_time import (MIN_STEPS, compute_bound, gc_pressure, h2d_bound,
                                        input_bound, insufficient_data, untraced_work)
from traceml.diagnose.stragglers import comm_bound, cores_taken_by_others, straggler
from traceml.records import (CodeSample, CompileRecord, Finding, FindingKind, HostSyncSample, LayerCapture, OomRecord,
                             Severity, SystemSample, window_end_unix_s)

SEVERITY_ORDER: Dict[str, int] = {Severity.CRIT: 0, Severity.WARN: 1, Severity.INFO: 2}
MEMORY_KINDS = (FindingKind.MEMORY_CREEP, FindingKind.MEMORY_PRESSURE)
VERDICT_SHARE = 0.10  # a finding worth less than this share of the run is never the verdict
# Share-based findings a stall can explain, and what the stall is in their words.
STALL_CAUSES: Dict[str, Tuple[str, ...]] = {FindingKind.UNTRACED_WORK: ("outside", "untraced"), FindingKind.INPUT_BOUND: ("input_wait",),
                FindingKind.GC_PRESSURE: ("gc",)}
STALL_WORDS = {"outside": "work between steps", "untraced": "untraced work inside the step",
               "input_wait": "waiting for the DataLoader", "gc": "garbage collection"}


@dataclass
class DiagnosisInput:
    """Everything the rules read of a run. report.diagnosis builds it one way for the live views
    and the final summary, so both give the same verdict on the same steps.

    window: the measured steps (warm-up left out); steps_seen: the run's steps so far; ranks:
    every rank's row (rollup.rank_medians; the rank rules need two ranks or more); limits and
    peaks: what memory there is and what the run reached; oom: the step that ran out of memory;
    layers_alive: the deep-dive's leaf layers whose outputs outlive their step; steps_found_by:
    how steps were found (records.STEPS_FROM_*, or a trainer), for the words; system: the
    collector's node's samples, to tell a machine-wide stall and a shared node; nodes: how many
    hosts the ranks run on (the samples are of one of them); on_cpu: whether every rank computes
    on the CPU, where a shared core slows the compute itself; stalls: the window's slow steps
    (the summary reports their warm-up too); captures: deep-dive taken when a rule fired in the
    probe, named in the evidence of the finding it belongs to; goodput: the run's wall time by
    part (planned work and startup are measured against it); compiles: torch.compile's
    compilations, for RECOMPILATION; host_syncs: the probe's sampled host syncs (CUDA), for
    HOST_SYNC; loader: the training DataLoader's figures (analysis.loaders), for what
    INPUT_BOUND advises; ledger: what holds each rank's memory (analysis.ledger), for which part
    the memory rules name; code: where the untimed time went (the probe's sampled stacks), for
    the code UNTRACED_WORK and SLOW_STARTUP name.
    """

    window: Window
    steps_seen: int
    ranks: List[RankRow] = field(default_factory=list)
    limits: MemoryLimits = field(default_factory=MemoryLimits)
    peak_device_bytes: Optional[int] = None
    peak_rss_bytes: Optional[int] = None
    oom: Optional[OomRecord] = None
    layers_alive: List[AliveLayer] = field(default_factory=list)
    steps_found_by: Optional[str] = None
    system: Sequence[SystemSample] = ()
    nodes: int = 1
    on_cpu: bool = False
    stalls: Optional[Stalls] = None
    captures: Sequence[LayerCapture] = ()
    goodput: Optional[Goodput] = None
    compiles: Sequence[CompileRecord] = ()
    host_syncs: Sequence[HostSyncSample] = ()
    loader: Optional[LoaderFigures] = None
    ledger: List[LedgerRow] = field(default_factory=list)
    code: Sequence[CodeSample] = ()


def diagnose(run: DiagnosisInput) -> List[Finding]:
    """Every finding for the run's window, the primary diagnosis first (see the ranking above)."""
    window, limits, oom, ledger, goodput = run.window, run.limits, run.oom, run.ledger, run.goodput
    findings: List[Finding] = [out_of_memory(oom, limits)] if oom is not None else []
    if run.steps_seen < MIN_STEPS:
        return findings + [insufficient_data(run.steps_seen, run.steps_found_by)]
    stalls = run.stalls if run.stalls is not None else Stalls(window, run.system)
    shares = [finding for finding in (input_bound(window, run.loader), h2d_bound(window),
                                      untraced_work(window, run.steps_found_by, run.code), gc_pressure(window))
              if finding is not None]
    findings += _one_finding_per_cause(shares, stalls) + planned_work(window, goodput)
    run_ms = goodput.wall_s * 1e3 if goodput is not None else window.total_ms
    after_step = window.steps[0].step if len(window) else 0
    findings += [finding for finding in (recompilations(run.compiles, after_step, run_ms), slow_startup(goodput, run.code),
                                         host_sync(run.host_syncs, window))
                 if finding is not None]
    findings += [finding for finding in (compute_bound(window),
                                         memory_creep(window, limits, run.layers_alive, ledger))
                 if finding is not None]
    if oom is None:  # the post-mortem already says how full memory was
        findings += [f for f in (memory_pressure(window, limits, run.peak_device_bytes, run.peak_rss_bytes,
                                                 ledger),) if f]
    if len(run.ranks) > 1:
        sharded_by = next((row["sharded_by"] for row in ledger if row["sharded_by"]), None) or ""
        # Other processes on the ranks' node slow a CPU rank's compute: known where the ranks
        # share one node, the collector's (`traceml run` starts it beside rank 0).
        cores_taken = None
        if run.nodes == 1 and run.on_cpu and len(window):
            cores_taken = cores_taken_by_others(run.system, window.steps[0].start_unix_s,
                                                window_end_unix_s(window.steps[-1]))
        findings += [f for f in (straggler(run.ranks, window.step_median_ms, cores_taken),
                                 comm_bound(run.ranks, window.step_median_ms, sharded_by)) if f]
    if not any(_group(f) <= 3 for f in findings):
        findings += [f for f in (compute_bound(window, healthy=True),) if f]
    findings = rank(findings, goodput.share("training") if goodput is not None and goodput.parts else 1.0)
    attach_captures(findings, run.captures)
    return findings


def _one_finding_per_cause(shares: List[Finding], stalls: Stalls) -> List[Finding]:
    """Slow steps that explain a share-based finding are told in it, by their period; the rest
    are STEP_SPIKES (planned work is never in a step's time: it has findings of its own)."""
    if not stalls.episodes:
        return shares
    for index, finding in enumerate(shares):
        phases = STALL_CAUSES.get(finding.kind, ())
        if (stalls.phase in phases and stalls.explained_by(*phases)
                and stalls.cost_share >= 0.5 * finding.figure("share")):
            shares[index] = periodic(finding, stalls, STALL_WORDS[stalls.phase], stalls.phase)
            return shares
    if stalls.period and stalls.phase in STALL_WORDS and stalls.explained_by(stalls.phase):
        # A part that stalls on a period is that part's cause even when its mean share stays
        # under the cause's own line (a sync every 10th step on a busy machine).
        # Its share is the part's own time in the stalls, the figure its words add up to.
        cause = next(kind for kind, phases in STALL_CAUSES.items() if stalls.phase in phases)
        if any(finding.kind == cause for finding in shares):
            return shares  # a small part of the cause's finding already made: one finding per cause
        share = stalls.phase_cost_share(stalls.phase)
        base = Finding(kind=cause, severity=Severity.WARN if share >= WARN_COST_SHARE else Severity.INFO,
                       summary="", action="", evidence={"share": round(share, 4)})
        return shares + [periodic(base, stalls, STALL_WORDS[stalls.phase], stalls.phase)]
    spikes = step_spikes(stalls)
    return shares + ([spikes] if spikes is not None else [])


def worth(finding: Finding) -> float:
    """The share of the run's time acting on this finding could win."""
    return finding.figure("share")


def _group(finding: Finding) -> int:
    if finding.evidence.get("oom"):
        return 0
    if finding.kind in MEMORY_KINDS and finding.severity == Severity.CRIT:
        return 1
    if finding.kind == FindingKind.COMPUTE_BOUND:
        return 3
    if finding.kind in MEMORY_KINDS or finding.kind == FindingKind.INSUFFICIENT_DATA:
        return 4
    if finding.kind == FindingKind.STEP_SPIKES and finding.evidence.get("machine_wide"):
        return 4  # the machine's, not the run's: the verdict stays what it is on a quiet machine
    if finding.severity != Severity.INFO and worth(finding) >= VERDICT_SHARE:
        return 2
    return 4


# Kinds whose share is of the run's wall time; every other kind's is of the step.
RUN_SHARE_KINDS = (FindingKind.EVAL_HEAVY, FindingKind.CHECKPOINT_STALL, FindingKind.SLOW_STARTUP,
                   FindingKind.RECOMPILATION)


def rank(findings: List[Finding], training_share: float = 1.0) -> List[Finding]:
    """The primary diagnosis first: see the module's docstring. Findings are ordered by the run
    time they could win: a share of the step weighs as that share of the training's part of the
    run (training_share), so a step-based finding and a run-based one compare like for like."""
    def run_worth(finding: Finding) -> float:
        return worth(finding) * (1.0 if finding.kind in RUN_SHARE_KINDS else training_share)

    return sorted(findings, key=lambda f: (_group(f), -run_worth(f), SEVERITY_ORDER[f.severity]))


__all__ = ["diagnose", "DiagnosisInput", "rank", "worth", "Finding", "MemoryLimits", "SEVERITY_ORDER", "Stalls"]
