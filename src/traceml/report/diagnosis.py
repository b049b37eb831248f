"""What the rules read of a run, gathered one way whether the records come from the store at the
run's end (report.summary) or from the collector while it trains (report.live): the same steps
give the same verdict live and on the card."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Type, cast

import msgspec

from traceml.analysis.goodput import Goodput
from traceml.analysis.ledger import ledger_rows
from traceml.analysis.loaders import loader_figures
from traceml.analysis.rollup import Window, max_present, rank_medians
from traceml.collector.store import Store
from traceml.diagnose import DiagnosisInput, MemoryLimits, Stalls
from traceml.record_types import RECORD_TYPES, R, RecordsByType
from traceml.records import (CodeSample, CompileRecord, HostSyncSample, LayerCapture, LayerReport, LoaderSample, MemoryLedger,
                             OomRecord, RankEnd, RankHello, RolledStep, StepRecord, SystemSample, warmup_steps)
from traceml.report.deep_dive import deep_dive_figures, layers_alive


@dataclass
class RunRecords:
    """A run's records as the rules need them: from the store, all of each type the collector
    keeps (stored_records); from the collector, those it keeps (record_types.py: how many)."""

    rolled: Sequence[RolledStep]  # steps across ranks, in step order
    kept: RecordsByType = field(default_factory=dict)  # by record type (StepRecord: every rank's)
    goodput: Optional[Goodput] = None
    steps_seen: Optional[int] = None  # the run's steps so far; None: as many as `rolled` holds
    recent_steps: Optional[int] = None  # the window keeps only this many of the latest steps

    def of(self, record_type: Type[R]) -> List[R]:
        return records_of(self.kept, record_type)

    @property
    def layer_report(self) -> Optional[LayerReport]:
        """Rank 0's deep-dive (or the first rank's)."""
        reports = self.of(LayerReport)
        return reports[0] if reports else None


def records_of(kept: RecordsByType, record_type: Type[R]) -> List[R]:
    """The records of one type among records kept by their type."""
    return cast(List[R], list(kept.get(record_type, ())))


def stored_records(store: Store) -> Dict[Type[msgspec.Struct], List[msgspec.Struct]]:
    """Every stored record of each type the collector keeps for the rules, by type; but the
    steps, which a long run's summary samples."""
    return {record: store.records(record) for record, kind in RECORD_TYPES.items()
            if kind.recent != 0 and kind.table and record is not StepRecord}


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
    hellos, system, steps = run.of(RankHello), run.of(SystemSample), run.of(StepRecord)
    ooms = run.of(OomRecord)
    return DiagnosisInput(
        window=window, steps_seen=steps_seen,
        ranks=rank_medians(steps, skip_steps=warmup),
        limits=MemoryLimits.of_run(hellos, system[-1] if system else None),
        peak_device_bytes=max_present(step.device_peak_bytes for step in run.rolled),
        peak_rss_bytes=max_present(step.host_rss_bytes for step in run.rolled),
        oom=ooms[0] if ooms else None, layers_alive=layers_alive(layers),
        steps_found_by=steps_found_by(hellos, run.of(RankEnd)), system=system,
        nodes=len({hello.host for hello in hellos}) or 1,
        on_cpu=bool(hellos) and all(hello.device == "cpu" for hello in hellos),
        stalls=Stalls(window, system), captures=run.of(LayerCapture), goodput=run.goodput,
        compiles=run.of(CompileRecord), host_syncs=run.of(HostSyncSample),
        loader=loader_figures(run.of(LoaderSample), window, hellos),
        ledger=ledger_rows(run.of(MemoryLedger), steps, layers, first_step=first_step),
        code=run.of(CodeSample))


def steps_found_by(hellos: Sequence[RankHello], ends: Sequence[RankEnd]) -> Optional[str]:
    """How rank 0 found its steps: its goodbye knows best (an explicit trace_step may have
    replaced inference late); a rank that died, or is still training, said so in its hello."""
    said = [r.steps_from for r in sorted(ends, key=lambda r: r.rank) if r.steps_from] or \
        [r.steps_from for r in sorted(hellos, key=lambda r: r.rank) if r.steps_from]
    return said[0] if said else None
