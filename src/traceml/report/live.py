"""The live state every live view shows: the collector's recent steps, diagnosed by the rules
the final summary uses, with their input built the same way (report.diagnosis), at one moment.
The terminal and the web dashboard both read it."""
from __future__ import annotations

import statistics
import sys
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Set, TextIO, Tuple, cast

from traceml.analysis.goodput import Goodput
from traceml.analysis.ledger import LedgerRow
from traceml.analysis.rollup import RankRow, Spread, Window, rank_spread
from traceml.diagnose import MemoryLimits, diagnose
from traceml.diagnose.hangs import PULSED_STATES, Hang, HangState, RankProgress, find_hang, hang_after_s_from_env
from traceml.diagnose.untimed import CodeSummary, untimed_summary
from traceml.records import (ALERT_SEVERITIES, Finding, FindingKind, LayerReport, RankEnd, RankHello, RankPulse, StepRecord,
                             SystemSample, warmup_steps, window_end_unix_s)
from traceml.report.diagnosis import RunRecords, diagnosis_input

if TYPE_CHECKING:  # re-exported: the views name the collector they are handed, through the report
    from traceml.collector.server import Collector as Collector

RECENT_WINDOW = 200  # steps the live figures are computed over


class LiveState:
    """What the dashboard shows, read from the collector at one moment."""

    def __init__(self, script: str, elapsed_s: float, window: Window, steps_seen: int,
                 ranks: List[RankRow], world_size: int, system: Optional[SystemSample],
                 limits: MemoryLimits, layers: Optional[LayerReport], findings: List[Finding],
                 alerts: List[Tuple[float, Finding]]):
        self.script, self.elapsed_s, self.window, self.steps_seen = script, elapsed_s, window, steps_seen
        self.ranks, self.world_size, self.system, self.limits = ranks, world_size, system, limits
        self.layers, self.findings, self.alerts = layers, findings, alerts
        self.spread: Dict[str, Spread] = {}  # across ranks, per phase (rollup.rank_spread)
        self.goodput: Optional[Goodput] = None  # the run's wall time so far, by part
        self.ledger: List[LedgerRow] = []  # what holds each rank's memory (analysis.ledger)
        self.code: CodeSummary = {}  # where the untimed time goes (diagnose.untimed.untimed_summary)


def snapshot(collector: Collector, script: str, elapsed_s: float,
             alerts: List[Tuple[float, Finding]]) -> LiveState:
    """Read the collector's live state and diagnose it as the summary does (report.diagnosis),
    over the latest RECENT_WINDOW steps.

    `alerts` collects each finding kind the first time it appears (it is updated in place).
    """
    if collector.live is None or collector.run_time is None:
        raise ValueError("a live snapshot needs the collector's rollup and wall-time tally")
    rolled = list(collector.live.recent)
    steps_seen = collector.live.newest_step + 1
    # The run hands the collector an analysis.goodput.RunTime and a HangWatch (lifecycle.py); the
    # collector, which imports no analysis, types what they return as object.
    goodput = cast(Optional[Goodput], collector.run_time.goodput(now_unix_s=time.time()))
    run = RunRecords(rolled=rolled, kept=collector.everything_kept(), goodput=goodput, steps_seen=steps_seen,
                     recent_steps=RECENT_WINDOW)
    records = run.of(StepRecord)
    inputs = diagnosis_input(run)
    findings = diagnose(inputs) if rolled else []
    hang = cast(Optional[Hang], collector.hang_watch.hang) if collector.hang_watch is not None else None
    if hang is not None:
        findings.insert(0, hang.finding)
    seen = {finding.kind for _, finding in alerts}
    for finding in findings:
        if (finding.kind not in seen and finding.kind != FindingKind.INSUFFICIENT_DATA
                and finding.severity in ALERT_SEVERITIES):
            alerts.append((elapsed_s, finding))
    ranks = inputs.ranks if len({record.rank for record in records}) > 1 else []
    state = LiveState(script, elapsed_s, inputs.window, steps_seen, ranks, collector.world_size,
                      collector.latest_system, inputs.limits, run.layer_report, findings, alerts)
    state.goodput = inputs.goodput
    state.ledger = inputs.ledger
    state.code = untimed_summary(inputs.code, inputs.window, inputs.goodput)
    if ranks:
        state.spread = rank_spread(records, skip_steps=warmup_steps(steps_seen))
    return state


class HangWatch:
    """The collector's hang check (every second, on its loop): the HANG finding while one holds
    (`hang`), one line on stderr when one is raised or names another rank, and the hang in the
    store's meta for the summary, kept once the run starts ending under it (the ranks the
    launcher then stops are not the cause). A moment the rule cannot place a rank it placed (a
    step sent late, the rank's next pulse on its way) neither ends the hang nor makes it vaguer."""

    def __init__(self, hang_after_s: Optional[float] = None, stderr: Optional[TextIO] = None):
        self.hang_after_s = hang_after_s if hang_after_s is not None else hang_after_s_from_env()
        self.hang: Optional[Hang] = None
        self._stderr = stderr
        self._told: Optional[Tuple[Optional[int], Tuple[int, ...], Tuple[HangState, ...]]] = None
        self._ranks_left_at_raise: Optional[int] = None
        self._raised_at_unix_s = 0.0

    def check(self, collector: Collector, now_unix_s: float) -> None:
        progress = live_progress(collector, now_unix_s)
        left = sum(p.gone or p.said_goodbye for p in progress)
        if self.hang is not None and left > (self._ranks_left_at_raise or 0):
            # Ranks leave under a hang: the run is being stopped, and the hang stays as it was,
            # unless a stalled rank has ended a step since it was raised (a slow step after
            # all). A rank stopped with SIGTERM sends its last inferred step on the way out:
            # that step ended before the hang, and is no progress.
            if not self._stepped_since_raise(progress) & set(self.hang.stalled_ranks):
                return
        hang = find_hang(progress, now_unix_s, self.hang_after_s)
        if self.hang is not None and self._lost_sight(hang, progress):
            return
        if hang is None:
            if self.hang is not None:
                self.hang = self._told = None
                collector.store.set_meta({"hang": None})
            return
        if self.hang is None:
            self._ranks_left_at_raise = left
            self._raised_at_unix_s = now_unix_s
        self.hang = hang
        told = (hang.finding.rank, tuple(hang.stalled_ranks), tuple(p["state"] for p in hang.ranks))
        if told != self._told:
            self._told = told
            print(f"traceml: HANG: {hang.finding.summary}", file=self._stderr or sys.stderr, flush=True)
        collector.store.set_meta({"hang": hang.to_builtins()})

    def _lost_sight(self, hang: Optional[Hang], progress: List[RankProgress]) -> bool:
        """Whether the rule has lost sight of a rank the hang told placed (in a collective, a
        DataLoader wait, its own code) that has ended no step since: its late step's record came
        before its next pulse. The hang told stands until that pulse, or until the rank steps."""
        told = self.hang.ranks if self.hang is not None else []
        placed = {place["rank"] for place in told if place["state"] in PULSED_STATES}
        unplaced = placed if hang is None else {place["rank"] for place in hang.ranks
                                                if place["state"] == HangState.STEPPING}
        return bool((placed & unplaced) - self._stepped_since_raise(progress))

    def _stepped_since_raise(self, progress: List[RankProgress]) -> Set[int]:
        """The ranks that ended a step after the hang was raised (a step sent late, that ended
        before, is no progress)."""
        return {p.rank for p in progress if p.last_progress_unix_s > self._raised_at_unix_s}


def live_progress(collector: Collector, now_unix_s: float) -> List[RankProgress]:
    """Each rank's RankProgress from the collector's recent state."""
    progress = []
    steps, pulses, ends = collector.kept_by(StepRecord), collector.latest(RankPulse), collector.latest(RankEnd)
    for key, hello in collector.latest(RankHello).items():
        rank = cast(int, key)  # hellos are kept by rank (record_types.py)
        recent = steps.get(rank, [])
        steps_ended = recent[-1].step + 1 if recent else 0
        last = window_end_unix_s(recent[-1]) if recent else hello.started_at_unix_s
        median = statistics.median(r.step_ms for r in recent[-50:]) if recent else None
        progress.append(RankProgress(
            rank=rank, pid=hello.pid, host=hello.host, steps_ended=steps_ended, last_progress_unix_s=last,
            median_step_ms=median, last_heard_unix_s=collector.last_heard_unix_s.get(rank, now_unix_s),
            pulse=pulses.get(rank), said_goodbye=rank in ends,
            gone=rank in collector.lost_ranks))
    return progress
