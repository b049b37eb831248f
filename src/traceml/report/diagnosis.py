"""What the rules read of a run, gathered one way whether the records come from the store at the
run's end (report.summary) or from the collector while it trains (report.live): the same steps
give the same verdict live and on the card."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from traceml.analysis.goodput import Goodput
from traceml.analysis.ledger import ledger_rows
from traceml.analysis.loaders import loader_figures
from traceml.analysis.rollup import Window, max_present, rank_medians
from traceml.diagnose import DiagnosisInput, MemoryLimits, Stalls
from traceml.records import (CodeSample, CompileRecord, HostSyncSample, LayerCapture, LayerReport, LoaderSample, MemoryLedger,
                             OomRecord, RankEnd, RankHello, RolledStep, StepRecord, SystemSample, warmup_steps)
from traceml.report.deep_dive import deep_dive_figures, layers_alive


@dataclass
class RunRecords:
    """A run's records as the rules need them: from the store, all of them; from the collector,
    those it keeps (its recent steps, system samples, DataLoader figures and ledger readings)."""

    rolled: Sequence[RolledStep]  # steps across ranks, in step order
    steps: Sequence[StepRecord]  # every rank's own step records
    hellos: Sequence[RankHello] = ()
    ends: Sequence[RankEnd] = ()
    system: Sequence[SystemSample] = ()
    ooms: Sequence[OomRecord] = ()
    compiles: Sequence[CompileRecord] = ()
    host_syncs: Sequence[HostSyncSample] = ()
    captures: Sequence[LayerCapture] = ()
    loader_samples: Sequence[LoaderSample] = ()
    ledgers: Sequence[MemoryLedger] = ()
    code: Sequence[CodeSample] = ()  # where the untimed time went, each rank's latest of each part
    layer_report: Optional[LayerReport] = None
    goodput: Optional[Goodput] = None
    steps_seen: Optional[int] = None  # the run's steps so far; None: as many as `rolled` holds
    recent_steps: Optional[int] = None  # the window keeps only this many of the latest steps


def diagnosis_input(run: RunRecords) -> DiagnosisInput:
    """The rules' input for these records: the window after the warm-up (records.warmup_steps,
    counted from the run's first step), every rank's row over the same steps, and the figures
    the rules read beside them."""
    steps_seen = run.steps_seen if run.steps_seen is not None else len(run.rolled)
    warmup = warmup_steps(steps_seen)
    recent = run.rolled[-run.recent_steps:] if run.recent_steps else run.rolled
    window = Window([step for step in recent if step.step >= warmup])
    first_step = window.steps[0].step if len(window) else None
    layers = deep_dive_figures(run.layer_report)["layers"]
    return DiagnosisInput(
        window=window, steps_seen=steps_seen,
        ranks=rank_medians(list(run.steps), skip_steps=warmup),
        limits=MemoryLimits.of_run(list(run.hellos), run.system[-1] if run.system else None),
        peak_device_bytes=max_present(step.device_peak_bytes for step in run.rolled),
        peak_rss_bytes=max_present(step.host_rss_bytes for step in run.rolled),
        oom=run.ooms[0] if run.ooms else None, layers_alive=layers_alive(layers),
        steps_found_by=steps_found_by(run.hellos, run.ends), system=list(run.system),
        nodes=len({hello.host for hello in run.hellos}) or 1,
        on_cpu=bool(run.hellos) and all(hello.device == "cpu" for hello in run.hellos),
        stalls=Stalls(window, list(run.system)), captures=list(run.captures), goodput=run.goodput,
        compiles=list(run.compiles), host_syncs=list(run.host_syncs),
        loader=loader_figures(list(run.loader_samples), window, list(run.hellos)),
        ledger=ledger_rows(list(run.ledgers), list(run.steps), layers, first_step=first_step),
        code=list(run.code))


def steps_found_by(hellos: Sequence[RankHello], ends: Sequence[RankEnd]) -> Optional[str]:
    """How rank 0 found its steps: its goodbye knows best (an explicit trace_step may have
    replaced inference late); a rank that died, or is still training, said so in its hello."""
    for records in (ends, hellos):
        said = [r.steps_from for r in sorted(records, key=lambda r: r.rank) if r.steps_from]
        if said:
            return said[0]
    return None
