"""The end-of-run summary built from the store: final_summary.json (its keys told in docs/,
page by page), and traceml.summary()'s flat figures. The card and the other views print it (views/)."""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List, NamedTuple, Optional, TypedDict, Union, cast

import msgspec

from traceml import rundir
from traceml.analysis.goodput import PartTime, RunTime, Startup
from traceml.analysis.hardware import device_peak_tflops
from traceml.analysis.ledger import DeviceMesh, LedgerRow, device_mesh, ledger_history
from traceml.analysis.rollup import RankRow, Spread, max_present, rank_row, rank_spread, roll_up
from traceml.collector.store import Store
from traceml.diagnose import diagnose
from traceml.diagnose.captures import GrownLayer, grown_layers
from traceml.diagnose.hangs import HangSummary, MissingRank, RankExit, StoredHang, rank_lost
from traceml.diagnose.host_sync import SyncLine, sync_sites
from traceml.diagnose.run_time import CompileSummary, compile_summary
from traceml.diagnose.spikes import WarmupTransient
from traceml.diagnose.untimed import CodeSummary, untimed_summary
from traceml.records import (CompileRecord, Evidence, Finding, LayerCapture, MemoryLedger, RankEnd, RankHello, RolledStep,
                             StepRecord, SystemSample, GpuSample, warmup_steps)
from traceml.analysis.layer_rows import DeepDive, LayerRow
from traceml.report.deep_dive import deep_dive_figures
from traceml.report.diagnosis import RunRecords, diagnosis_input, records_of, stored_records

SCHEMA_VERSION = 1
RANK_SAMPLE_STEPS = 10_000  # beyond this many steps, per-rank figures read every k-th step


# -- final_summary.json's shape: what build_summary writes and the views read ----------------------
# TypedDicts: the JSON is the dict as it is, and a key a view misspells is a type error. Keys
# added after a run was written are total=False where the views read them (older runs open).
class RunPart(TypedDict):
    script: str
    argv: List[str]
    exit_code: Optional[int]
    started_at: str  # ISO 8601, UTC
    duration_s: float
    world_size: int
    devices: List[str]
    torch_version: Optional[str]


class StepsPart(TypedDict):
    count: int
    warmup_excluded: int
    measured: int
    records_dropped: int
    device_timed: bool
    found_by: Optional[str]
    warmup_transients: List[WarmupTransient]
    rank_figures_every_n_steps: int


class _PhaseFigures(TypedDict):
    median_ms: float
    mean_ms: float
    share: float  # of the step


class PhaseFigures(_PhaseFigures, total=False):
    p90_ms: float  # the whole step's ("step") alone


class _Throughput(TypedDict):
    steps_per_s: float
    samples_per_s: Optional[float]
    samples_per_step: Optional[float]
    tokens_per_s: Optional[float]
    padding_share: Optional[float]
    flops_per_step: Optional[float]  # under deep-dive
    achieved_tflops: Optional[float]
    mfu: Optional[float]


class Throughput(_Throughput, total=False):
    device_peak_tflops: Optional[float]  # where FLOPs were counted


class MemoryPart(TypedDict):
    device_peak_bytes: Optional[int]
    device_capacity_bytes: Optional[int]
    host_rss_peak_bytes: Optional[int]
    creep_bytes_per_step: float
    creep_measured_on: str
    ledger: List[LedgerRow]
    ledger_history: List[Dict[str, int]]


class AvgPeak(TypedDict):
    avg: float
    peak: float


class GpuFigures(TypedDict):
    index: int
    utilization_percent: AvgPeak
    memory_used_bytes: AvgPeak
    memory_total_bytes: int
    temperature_c: Optional[AvgPeak]  # None where NVML cannot read it
    power_w: Optional[AvgPeak]


class _SystemSamples(TypedDict):
    samples: int


class SystemPart(_SystemSamples, total=False):
    """The node's readings; the figures only where there was a sample."""

    cpu_percent: AvgPeak
    training_cpu_percent: AvgPeak
    ram_used_bytes: AvgPeak
    ram_total_bytes: int
    training_rss_bytes: AvgPeak
    gpus: List[GpuFigures]


class SpanFigures(TypedDict):
    """A user span's figures over the measured steps (see span_figures)."""

    count: int
    steps: int
    median_ms: float
    total_ms_per_step: float
    share: float


class CapturePart(TypedDict):
    rank: int
    step: int
    reason: str
    detail: str
    layers: List[GrownLayer]  # the ten most grown


class FindingDict(TypedDict):
    """A Finding as JSON keeps it (msgspec.to_builtins)."""

    kind: str
    severity: str
    summary: str
    action: str
    rank: Optional[int]
    evidence: Evidence


class FinalSummary(TypedDict):
    """final_summary.json, its keys in the order written (docs/ tells each)."""

    schema_version: int
    run: RunPart
    steps: StepsPart
    phases: Dict[str, PhaseFigures]  # each phase, and "step"
    throughput: Throughput
    goodput: Optional[Dict[str, PartTime]]  # by part of the run's wall time
    startup: Optional[Startup]
    compile: Optional[CompileSummary]
    host_syncs: List[SyncLine]
    code: CodeSummary
    memory: MemoryPart
    system: SystemPart
    ranks: List[RankRow]
    mesh: Optional[DeviceMesh]
    hang: Optional[HangSummary]
    rank_spread: Dict[str, Spread]
    missing_ranks: List[MissingRank]
    layers: List[LayerRow]
    deep_dive: Optional[DeepDive]
    spans: Dict[str, SpanFigures]
    captures: List[CapturePart]
    primary_diagnosis: Optional[FindingDict]
    findings: List[FindingDict]


class RunFacts(msgspec.Struct):
    """What the launcher (or, without one, rank 0's hello and goodbye) knows about the run."""

    script: str
    argv: List[str]
    exit_code: Optional[int]
    started_at_unix_s: float
    ended_at_unix_s: float

    @classmethod
    def from_store(cls, store: Store, script: Optional[str] = None,
                   ended_at_unix_s: Optional[float] = None) -> "RunFacts":
        """With no launcher to ask: rank 0's hello (its argv, its start) and goodbye (its exit code)."""
        hellos, ends = store.records(RankHello), store.records(RankEnd)
        rank0 = next((h for h in hellos if h.rank == 0), hellos[0] if hellos else None)
        end0 = next((e for e in ends if e.rank == 0), None)
        argv = rank0.argv if rank0 is not None else [script or "python"]
        return cls(script=os.path.basename(argv[0]) if argv else (script or ""), argv=argv,
                   exit_code=end0.exit_code if end0 is not None else None,
                   started_at_unix_s=rank0.started_at_unix_s if rank0 is not None else time.time(),
                   ended_at_unix_s=ended_at_unix_s or time.time())


class RunData:
    """Everything the summary and the report read, taken from the store and rolled up once."""

    def __init__(self, store: Store):
        meta = store.meta()
        # The collector rolled each step up as it completed and kept it in the store; a store
        # without them (an older run, a collector that died) is rolled up here.
        self.rank_sample_every = 1
        if meta.get("rolled_complete"):
            self.rolled: List[RolledStep] = store.rolled_steps()
            # Per-rank figures read every record of a run up to RANK_SAMPLE_STEPS steps, and
            # every k-th step of a longer one (medians need no million records).
            self.rank_sample_every = max(1, len(self.rolled) // RANK_SAMPLE_STEPS)
            self.records = store.steps_every(self.rank_sample_every)
        else:
            self.records = store.steps()
            self.rolled = roll_up(self.records)
        self.warmup = warmup_steps(len(self.rolled))
        self.stored = stored_records(store)
        self.hellos: List[RankHello] = records_of(self.stored, RankHello)
        self.ends: List[RankEnd] = records_of(self.stored, RankEnd)
        self.samples: List[SystemSample] = records_of(self.stored, SystemSample)
        self.compiles: List[CompileRecord] = records_of(self.stored, CompileRecord)
        self.run_time = self._run_time(store, meta)
        self.goodput = self.run_time.goodput(now_unix_s=None)
        # What the rules read, built as the live views build it (report.diagnosis).
        run = RunRecords(rolled=self.rolled, kept={**self.stored, StepRecord: self.records}, goodput=self.goodput)
        self.layer_report = run.layer_report
        self.deep_dive = deep_dive_figures(self.layer_report)
        self.inputs = diagnosis_input(run)
        inputs = self.inputs
        self.window, self.ranks, self.stalls = inputs.window, inputs.ranks, inputs.stalls
        self.limits, self.found_by, self.loader, self.ledger = inputs.limits, inputs.steps_found_by, inputs.loader, \
            inputs.ledger
        self.captures: List[LayerCapture] = list(inputs.captures)
        if self.rank_sample_every > 1:
            self._exact_rank_counts(store)
            inputs.ranks = self.ranks
        self.spans = span_figures(store, self.window.steps[0].step if len(self.window) else None,
                                  sample_every=self.rank_sample_every)
        self.lost_ranks: List[int] = meta.get("lost_ranks", [])
        # How failed ranks ended, from their launcher (traceml.agent; the fork's own wait).
        self.rank_exits: Dict[int, RankExit] = {int(rank): status for rank, status
                                                in (meta.get("rank_exits") or {}).items()}
        self.missing_ranks = _missing_ranks(self)
        # A hang the collector saw and the run ended under (report.live.HangWatch).
        self.hang: Optional[StoredHang] = meta.get("hang")
        self.findings: List[Finding] = diagnose(inputs)
        self._say_how_the_run_stopped_first()

    def _say_how_the_run_stopped_first(self) -> None:
        """A hang the run ended under comes before the rules' findings, and a rank that died
        before that: its death is the cause a hang follows from."""
        if self.hang is not None:
            self.findings.insert(0, msgspec.convert(self.hang["finding"], Finding))
            for place in self.hang["ranks"]:
                if place["rank"] in self.rank_exits:
                    exit_code = self.rank_exits[place["rank"]].get("exit_code")
                    place["exit_code"] = exit_code
        world_size = max([hello.world_size for hello in self.hellos] + [1])
        lost = rank_lost(self.missing_ranks, self.rank_exits, world_size)
        if lost is not None:
            self.findings.insert(0, lost)

    def _exact_rank_counts(self, store: Store) -> None:
        """Sampled records give the medians; each rank's step count and last step (which say
        whether it went missing) come exactly from the store's (rank, step) key."""
        rows = {row["rank"]: row for row in self.ranks}
        for hello in self.hellos:
            last = store.step_bounds("steps", hello.rank)[1]
            if last is None:
                continue
            row = rows.get(hello.rank)
            if row is None:  # all its records fell between the sampled steps
                row = rows[hello.rank] = rank_row(hello.rank, [], last)
            row["last_step"] = last
            row["steps"] = store.step_count(hello.rank, since_step=self.warmup)
        self.ranks = [rows[rank] for rank in sorted(rows)]

    def _run_time(self, store: Store, meta: Dict[str, object]) -> RunTime:
        """Every rank's wall-time tally: the collector's, kept at the run's end, or (a run whose
        collector did not finish) tallied again from every step record, read once."""
        tallies = meta.get("run_time")
        if tallies is not None:
            return RunTime.from_builtins(cast(List[Dict[str, object]], tallies))
        steps = self.records if self.rank_sample_every == 1 else store.steps()
        return RunTime.of([*self.hellos, *steps, *self.compiles, *self.ends])



def span_figures(store: Store, first_step: Optional[int], sample_every: int = 1) -> Dict[str, SpanFigures]:
    """The user spans (Trace.span) over the measured steps (first_step on: the steps the phase
    table reads, warm-up left out), per name, the most time first:

    count: its calls; steps: the steps it ran in (each rank's step counts once per rank);
    median_ms: its summed time in a step, the median over the steps it ran in;
    total_ms_per_step: its time over all measured steps divided by their number (a step
        without it counts as 0); share: its time over all measured steps divided by those
        steps' summed step time (every rank's), which is total_ms_per_step over the mean step.

    A call between steps counts in the step whose window it falls in (the window runs to the
    next step's start), one after the last step in the last step, one in a step that never
    finished (work after the last update) nowhere: the store holds no record of that step.
    Each name is timed on its own: a span inside another counts in both, so shares need not
    add up, and spans overlap the phases. In a run sampled for its per-rank figures
    (sample_every > 1), the median reads every sample_every-th step of each name, its first
    included."""
    if first_step is None:
        return {}
    steps, step_total_ms = store.step_time_ms(first_step)
    step_ms: Dict[str, List[float]] = {}
    for name, ms in store.span_step_ms(first_step, sample_every):
        step_ms.setdefault(name, []).append(ms)
    rows: Dict[str, SpanFigures] = {name: {"count": calls, "steps": span_steps,
                   "median_ms": statistics.median(step_ms[name]),
                   "total_ms_per_step": total_ms / steps if steps else 0.0,
                   "share": total_ms / step_total_ms if step_total_ms > 0 else 0.0}
            for name, calls, span_steps, total_ms in store.span_totals(first_step)}
    return dict(sorted(rows.items(), key=lambda item: -item[1]["total_ms_per_step"]))


def device_names(hellos: List[RankHello]) -> List[str]:
    """The run's devices as the card names them: "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"."""
    return sorted({h.device_name if h.device == "cpu" else f"{h.device} ({h.device_name})"
                   for h in hellos})


def build_summary(data: RunData, facts: RunFacts) -> FinalSummary:
    window = data.window
    phases: Dict[str, PhaseFigures] = {name: msgspec.to_builtins(stats) for name, stats in window.phases.items()}
    phases["step"] = {"median_ms": window.step_median_ms, "mean_ms": window.step_mean_ms,
                      "p90_ms": window.step_p90_ms, "share": 1.0 if len(window) else 0.0}
    world_size = max([h.world_size for h in data.hellos] + [len({r.rank for r in data.records}), 1])
    findings: List[FindingDict] = [msgspec.to_builtins(f) for f in data.findings]
    stalls = data.stalls
    summary: FinalSummary = {
        "schema_version": SCHEMA_VERSION,
        "run": {
            "script": facts.script,
            "argv": facts.argv,
            "exit_code": facts.exit_code,
            "started_at": rundir.iso_time(facts.started_at_unix_s),
            "duration_s": round(facts.ended_at_unix_s - facts.started_at_unix_s, 3),
            "world_size": world_size,
            "devices": device_names(data.hellos),
            "torch_version": data.hellos[0].torch_version if data.hellos else None,
        },
        "steps": {
            "count": len(data.rolled),
            "warmup_excluded": data.warmup,
            "measured": len(window),
            "records_dropped": sum(end.records_dropped for end in data.ends),
            "device_timed": any(s.device_timed for s in window.steps),
            "found_by": data.found_by,
            # Slow steps early in the run that never came back (allocator, optimizer state,
            # caches warming up): noted here, never a finding.
            "warmup_transients": stalls.warmup_note() if stalls is not None else [],
            "rank_figures_every_n_steps": data.rank_sample_every,
        },
        "phases": phases,
        "throughput": _throughput(data),
        "goodput": data.goodput.parts if data.goodput is not None else None,
        "startup": data.goodput.startup if data.goodput is not None else None,
        "compile": compile_summary(data.compiles, after_step=data.warmup),
        # CUDA only: each line that made the host wait for the GPU in the sampled steps.
        "host_syncs": sync_sites(data.inputs.host_syncs),
        # Where the untimed time went (sampled stacks), each part at a tenth of its whole or more.
        "code": untimed_summary(data.inputs.code, window, data.goodput),
        "memory": _memory(data),
        "system": _system(data.samples),
        "ranks": data.ranks,
        "mesh": device_mesh(data.ledger, records_of(data.stored, MemoryLedger)),
        "hang": _told_hang(data.hang) if data.hang else None,
        "rank_spread": rank_spread(data.records, skip_steps=data.warmup),
        "missing_ranks": data.missing_ranks,
        "layers": data.deep_dive["layers"],
        "deep_dive": data.deep_dive["deep_dive"],
        "spans": data.spans,
        "captures": [{"rank": c.rank, "step": c.step, "reason": c.reason, "detail": c.detail,
                      "layers": grown_layers(c)[:10]} for c in data.captures],
        "primary_diagnosis": findings[0] if findings else None,
        "findings": findings,
    }
    return cast(FinalSummary, _rounded(summary))


def _told_hang(hang: StoredHang) -> HangSummary:
    """The stored hang less its finding (the summary lists that among the findings)."""
    return {"summary": hang["summary"], "stalled_ranks": hang["stalled_ranks"],
            "culprit_rank": hang["culprit_rank"], "ranks": hang["ranks"]}


def _throughput(data: RunData) -> Throughput:
    window = data.window
    flops = _model_flops(data)
    throughput: Throughput = {
        "steps_per_s": window.steps_per_s,
        "samples_per_s": window.samples_per_s,
        # The global batch: samples a step, summed over ranks (the median step's).
        "samples_per_step": statistics.median(s.samples for s in window.steps) if len(window) else None,
        "tokens_per_s": window.tokens_per_s,  # real tokens trained (labels, attention_mask), summed over ranks
        "padding_share": window.padding_share,
        "flops_per_step": flops.flops_per_step, "achieved_tflops": flops.achieved_tflops, "mfu": flops.mfu,
    }
    if flops.flops_per_step:  # the device's peak is said where FLOPs were counted
        throughput["device_peak_tflops"] = flops.device_peak_tflops
    return throughput


def flat_summary(records: List[StepRecord]) -> Dict[str, Union[int, float, str, None]]:
    """One rank's figures so far as a flat dict (traceml.summary()), for W&B or MLflow: the
    same rollup, warm-up and rules as the card, over the records this process sent."""
    rolled = roll_up(records)
    inputs = diagnosis_input(RunRecords(rolled=rolled))
    window = inputs.window
    findings = diagnose(inputs) if rolled else []
    flat: Dict[str, Union[int, float, str, None]] = {
        "traceml/steps": len(rolled),
        "traceml/step/median_ms": window.step_median_ms,
        "traceml/step/p90_ms": window.step_p90_ms,
        "traceml/step/mean_ms": window.step_mean_ms,
        "traceml/throughput/steps_per_s": window.steps_per_s,
        "traceml/throughput/samples_per_s": window.samples_per_s,
        "traceml/throughput/tokens_per_s": window.tokens_per_s,
        "traceml/throughput/padding_share": window.padding_share,
        "traceml/memory/device_peak_bytes": max_present(s.device_peak_bytes for s in rolled),
        "traceml/memory/host_rss_peak_bytes": max_present(s.host_rss_bytes for s in rolled),
        "traceml/diagnosis/primary": findings[0].kind if findings else None,
        "traceml/diagnosis/severity": findings[0].severity if findings else None,
    }
    for name, stats in window.phases.items():
        flat[f"traceml/phase/{name}/share"] = stats.share
        flat[f"traceml/phase/{name}/median_ms"] = stats.median_ms
        flat[f"traceml/phase/{name}/mean_ms"] = stats.mean_ms
    for finding in findings:
        flat[f"traceml/finding/{finding.kind}"] = finding.severity
    return flat


class _ModelFlops(NamedTuple):
    flops_per_step: Optional[float]
    achieved_tflops: Optional[float]
    mfu: Optional[float]
    device_peak_tflops: Optional[float]


def _model_flops(data: RunData) -> _ModelFlops:
    """Under deep-dive: FLOPs of a step (the mean of rank 0's sampled steps), what the device
    achieves, and MFU where the device's peak is known (not for CPUs)."""
    report = data.layer_report
    flops = report.flops_per_step if report is not None else None
    if not flops:
        return _ModelFlops(None, None, None, None)
    achieved = flops * data.window.steps_per_s / 1e12
    names = [h.device_name for h in data.hellos if h.device != "cpu"]
    peak = device_peak_tflops(names[0]) if names else None
    return _ModelFlops(flops, achieved, achieved / peak if peak else None, peak)


def _rounded(value: object) -> object:
    """Floats to 4 decimals (0.1 µs in ms), so the JSON reads as figures, not noise."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def _missing_ranks(data: RunData) -> List[MissingRank]:
    """Ranks that stopped reporting before the others and never said goodbye (died, killed),
    or that the run's world size promised and never reported at all; each with its exit status
    (negative: the signal that killed it) and pid where its launcher saw it end. A one-process
    run is missing its rank when a signal ended it before its goodbye."""
    world_size = max([h.world_size for h in data.hellos] + [1])
    if world_size < 2:
        status: RankExit = data.rank_exits.get(0, {})
        if data.ends or not data.hellos or (status.get("exit_code") or 0) >= 0:
            return []
        last = data.ranks[0]["last_step"] if data.ranks else -1
        return [{"rank": 0, "from_step": last + 1, **status}]
    if not data.ranks:
        return []
    said_goodbye = {end.rank for end in data.ends}
    last_step = {rank: -1 for rank in range(world_size)}  # -1: no step from that rank
    last_step.update({row["rank"]: row["last_step"] for row in data.ranks})
    last = max(last_step.values())
    # Lost: its connection dropped without a goodbye while others were still connected (the
    # collector saw it go first; the survivors a launcher then stops are not the cause).
    # Without that record: no goodbye and fewer steps than the others sent.
    lost = set(data.lost_ranks)
    return [{"rank": rank, "from_step": step + 1, **data.rank_exits.get(rank, {})}
            for rank, step in sorted(last_step.items())
            if rank not in said_goodbye and (rank in lost if lost else step < last)]


def _memory(data: RunData) -> MemoryPart:
    trend = data.window.memory_trend
    return {
        "device_peak_bytes": max_present(s.device_peak_bytes for s in data.rolled),
        "device_capacity_bytes": data.limits.device_capacity_bytes,
        "host_rss_peak_bytes": max_present(s.host_rss_bytes for s in data.rolled),
        "creep_bytes_per_step": round(trend.bytes_per_step, 1),
        "creep_measured_on": trend.measured_on,
        "ledger": data.ledger,
        "ledger_history": ledger_history(records_of(data.stored, MemoryLedger)),
    }


def _avg_peak(values: List[float]) -> AvgPeak:
    return {"avg": round(statistics.fmean(values), 2), "peak": round(max(values), 2)}


def _avg_peak_present(values: List[Optional[float]]) -> Optional[AvgPeak]:
    present = [value for value in values if value is not None]
    return _avg_peak(present) if present else None


def _system(samples: List[SystemSample]) -> SystemPart:
    if not samples:
        return {"samples": 0}

    gpus: List[GpuFigures] = []
    system: SystemPart = {
        "samples": len(samples),
        "cpu_percent": _avg_peak([s.cpu_percent for s in samples]),
        "training_cpu_percent": _avg_peak([s.training_cpu_percent for s in samples]),
        "ram_used_bytes": _avg_peak([float(s.ram_used_bytes) for s in samples]),
        "ram_total_bytes": samples[-1].ram_total_bytes,
        "training_rss_bytes": _avg_peak([float(s.training_rss_bytes) for s in samples]),
        "gpus": gpus,
    }
    by_gpu: Dict[int, List[GpuSample]] = {}
    for sample in samples:
        for gpu in sample.gpus:
            by_gpu.setdefault(gpu.index, []).append(gpu)
    for index, readings in sorted(by_gpu.items()):
        gpus.append({
            "index": index,
            "utilization_percent": _avg_peak([g.utilization_percent for g in readings]),
            "memory_used_bytes": _avg_peak([float(g.memory_used_bytes) for g in readings]),
            "memory_total_bytes": readings[-1].memory_total_bytes,
            # None where NVML cannot read them (some virtualised devices)
            "temperature_c": _avg_peak_present([g.temperature_c for g in readings]),
            "power_w": _avg_peak_present([g.power_w for g in readings]),
        })
    return system
