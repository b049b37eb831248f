"""One run as the web dashboard reads it: the store's series (downsampled by report.queries),
and the findings and figures of the live state while the run trains or of its summary once it
has ended. Every answer is JSON-ready; the views only route and word them."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, cast

from traceml import rundir
from traceml.analysis.ledger import LEDGER_PARTS, PART_WORDS, ledger_history, part_bytes
from traceml.analysis.rollup import comm_wait_parts
from traceml.collector.store import Store
from traceml.diagnose.stragglers import FindingOrDict, straggler_finding, straggler_rank
from traceml.diagnose.untimed import CodeSummary, code_lines
from traceml.records import ALL_PHASES, Finding, MemoryLedger, RankHello, warmup_steps
from traceml.report import queries
from traceml.report.live import LiveState, snapshot
from traceml.analysis.layer_rows import DeepDiveFigures
from traceml.report.deep_dive import deep_dive_figures
from traceml.report.summary import (FinalSummary, FindingDict, PhaseFigures, RunData, RunFacts, RunPart, build_summary,
                                    device_names)

if TYPE_CHECKING:
    from traceml.collector.server import Collector

# An endpoint's answer, as the page reads it (json.dumps writes it).
Answer = Dict[str, object]

LIVE_STATE_S = 0.5


class RunSource:
    """One run as the dashboard sees it: its store, and while it trains, its collector."""

    def __init__(self, run_dir: Path, store: Store, collector: Optional[Collector] = None, script: str = "",
                 started_at_unix_s: Optional[float] = None):
        self.run_dir = run_dir
        self.store = store
        self.collector = collector  # None for `traceml view`
        self.script = script
        self.started_at_unix_s = started_at_unix_s or time.time()
        self.summary: Optional[FinalSummary] = None  # once the run is over
        self._alerts: List[Tuple[float, Finding]] = []
        # Whole-run buckets, kept between requests: a refresh reads only the newest rows.
        self._steps = queries.step_buckets(store)
        self._own_time = queries.own_time_buckets(store)
        self._spans = queries.span_buckets(store)
        self._scalars = queries.scalar_buckets(store)
        self._lock = threading.Lock()  # the caches are shared by the request threads
        self._state: Optional[LiveState] = None  # the latest live snapshot, and when it was taken
        self._state_at = 0.0

    @classmethod
    def of_finished_run(cls, run_dir: Path) -> "RunSource":
        """A run directory on disk: its store, read-only, and its summary."""
        source = cls(run_dir, Store(os.fspath(rundir.finished_store(run_dir)), readonly=True))
        summary_path = run_dir / rundir.SUMMARY_JSON
        try:
            summary = cast(FinalSummary, json.loads(summary_path.read_text()))
        except (OSError, ValueError):  # a run cut short: summarize what the store holds
            summary = build_summary(RunData(source.store), RunFacts.from_store(source.store))
        source.summary = summary
        source.script = summary["run"]["script"]
        return source

    @classmethod
    def of_live_run(cls, run_dir: Optional[Path], store: Store, collector: Collector, script: str,
                    started_at_unix_s: float) -> "RunSource":
        """A run in progress: a read-only connection of our own to the collector's store (an
        in-memory store, when the run dir cannot be written, is shared under its lock)."""
        reader = store if store.path == ":memory:" else Store(store.path, readonly=True)
        return cls(run_dir or Path("."), reader, collector, script, started_at_unix_s)

    def live_state(self) -> LiveState:
        """The collector's live state, diagnosed at most every LIVE_STATE_S however many pages
        and endpoints ask: the rules run in the collector's process, beside the ingest."""
        with self._lock:
            now = time.monotonic()
            if self._state is None or now - self._state_at >= LIVE_STATE_S:
                assert self.collector is not None  # a live state: only while the run trains
                self._state = snapshot(self.collector, self.script,
                                       time.time() - self.started_at_unix_s, self._alerts)
                self._state_at = now
            return self._state

    def close(self) -> None:
        """Close our own read-only connection (never the collector's store we were lent)."""
        if self.store.readonly:
            self.store.close()

    @property
    def live(self) -> bool:
        return self.collector is not None and self.summary is None

    # -- what the endpoints answer ---------------------------------------------------------
    def overview(self) -> Answer:
        if not self.live or self.collector is None:
            return _overview_of_summary(self.summary, os.fspath(self.run_dir))
        state = self.live_state()
        elapsed_s = state.elapsed_s
        window = state.window
        findings = [_finding(f) for f in state.findings]
        return {
            "live": True, "script": self.script, "run_dir": os.fspath(self.run_dir),
            "elapsed_s": elapsed_s, "steps_seen": state.steps_seen, "world_size": state.world_size,
            "devices": device_names(list(self.collector.latest(RankHello).values())),
            "step": {"median_ms": window.step_median_ms, "p90_ms": window.step_p90_ms},
            "throughput": {"steps_per_s": window.steps_per_s, "samples_per_s": window.samples_per_s},
            "phases": {name: {"median_ms": stats.median_ms, "mean_ms": stats.mean_ms,
                              "share": stats.share} for name, stats in window.phases.items()},
            "goodput": state.goodput.parts if state.goodput is not None else None,
            "untimed": code_lines(state.code),
            "primary": findings[0] if findings else None, "findings": findings, "exit_code": None,
        }

    def steps(self, start: Optional[int], end: Optional[int], points: int) -> queries.StepSeries:
        capacity = self._capacity()
        if start is None and end is None:
            with self._lock:
                self._steps.refresh()
                series = queries.step_series(self._steps.coarsen(points), capacity)
            series["warmup_steps"] = self.warmup_steps()
            return series
        known = queries.step_range(self.store) or (0, -1)
        first = known[0] if start is None else max(start, known[0])
        last = known[1] if end is None else min(end, known[1])
        zoomed = queries.step_buckets(self.store).read_range(first, last, points)
        return queries.step_series(zoomed, capacity)

    def system(self, points: int) -> queries.SystemSeries:
        series = queries.system_series(self.store, points)
        latest = self.store.latest_system()  # the buckets' means do not carry the CPU count
        series["cpu_count"] = latest.cpu_count if latest is not None and latest.cpu_count else None
        return series

    def ranks(self, points: int) -> Answer:
        findings: Sequence[FindingOrDict]
        if self.live:
            state = self.live_state()
            rows, spread, findings = state.ranks, state.spread, state.findings
        else:
            # .get throughout: the summary file of an older run may lack a section
            summary = self.summary or cast(FinalSummary, {})
            rows, spread = summary.get("ranks", []), summary.get("rank_spread", {})
            findings = summary.get("findings", [])
        straggler = straggler_finding(findings)
        with self._lock:
            self._own_time.refresh()
            heatmap = queries.rank_heatmap(self._own_time.coarsen(points))
        # Each rank's comm wait by phase, as the card splits it: the page keeps no arithmetic of its own.
        told = [{**row, "comm_wait_parts": comm_wait_parts(row)} for row in rows]
        return {"ranks": told, "spread": spread, "straggler": straggler_rank(findings),
                "straggler_summary": _said(straggler) if straggler is not None else None,
                "heatmap": heatmap, "warmup_steps": self.warmup_steps()}

    def warmup_steps(self) -> int:
        """The first steps the summary leaves out as warm-up: the charts scale without them."""
        if self.live:
            return warmup_steps(self.live_state().steps_seen)
        steps = (self.summary or cast(FinalSummary, {})).get("steps")
        return steps.get("warmup_excluded", 0) if steps else 0

    def layers(self) -> DeepDiveFigures:
        if not self.live:
            summary = self.summary or cast(FinalSummary, {})
            return {"deep_dive": summary.get("deep_dive"), "layers": summary.get("layers", [])}
        return deep_dive_figures(self.live_state().layers)

    def memory(self) -> Answer:
        """The memory ledger: each rank's parts now (bytes by analysis.ledger.LEDGER_PARTS, the
        parts not measured left out), and every reading's counted parts over steps."""
        if self.live and self.collector is not None:
            rows = self.live_state().ledger
            history = ledger_history(self.collector.kept(MemoryLedger))
        else:
            memory = (self.summary or cast(FinalSummary, {})).get("memory")
            rows, history = (memory.get("ledger") or [], memory.get("ledger_history") or []) if memory else ([], [])
        return {"parts": list(LEDGER_PARTS), "words": PART_WORDS, "history": history,
                "ledger": [{"rank": row["rank"], "parts": part_bytes(row), "held": row["held"],
                            "measured_on": row["measured_on"], "activations_step": row["activations_step"],
                            "adapters": row.get("adapters") or None, "parameters": row["parameters"]}
                           for row in rows]}

    def timeline(self, steps: int) -> queries.Timeline:
        return queries.timeline(self.store, steps)

    def spans(self) -> queries.SpanTable:
        with self._lock:
            self._steps.refresh()
            self._spans.refresh()
            return queries.span_table(self._spans, queries.training_ms(self._steps))

    def scalars(self, points: int) -> queries.ScalarSeries:
        with self._lock:
            self._scalars.refresh()
            return queries.scalar_series(self._scalars.coarsen(points))

    def _capacity(self) -> Dict[str, Optional[int]]:
        """The lines memory is drawn against: the largest device, and the node's RAM."""
        if self.live and self.collector is not None:
            hellos = list(self.collector.latest(RankHello).values())
            system = self.collector.latest_system
            host = system.ram_total_bytes if system is not None else None
        else:
            hellos = self.store.records(RankHello)
            latest = self.store.latest_system()
            host = latest.ram_total_bytes if latest is not None else None
        device = max((h.device_capacity_bytes for h in hellos if h.device_capacity_bytes), default=None)
        return {"device_bytes": device, "host_bytes": host}


def _finding(finding: Finding) -> FindingDict:
    import msgspec

    return cast(FindingDict, msgspec.to_builtins(finding))


def _said(finding: FindingOrDict) -> object:
    """A finding's summary, whether the rules' Finding or the summary file's dict."""
    return finding.summary if isinstance(finding, Finding) else finding.get("summary")


def _overview_of_summary(summary: Optional[FinalSummary], run_dir: str) -> Answer:
    # .get throughout: the summary file of an older run may lack a section
    summary = summary or cast(FinalSummary, {})
    run = summary.get("run") or cast(RunPart, {})
    phases = summary.get("phases", {})
    step = phases.get("step") or cast(PhaseFigures, {})
    steps = summary.get("steps")
    return {
        "live": False, "script": run.get("script", ""), "run_dir": run_dir,
        "elapsed_s": run.get("duration_s", 0.0), "steps_seen": steps.get("count", 0) if steps else 0,
        "world_size": run.get("world_size", 1), "devices": run.get("devices", []),
        "step": {"median_ms": step.get("median_ms", 0.0), "p90_ms": step.get("p90_ms", 0.0)},
        "throughput": summary.get("throughput", {"steps_per_s": 0.0, "samples_per_s": None}),
        "phases": {name: phases[name] for name in ALL_PHASES if name in phases},
        "goodput": summary.get("goodput"),
        "untimed": code_lines(summary.get("code") or cast(CodeSummary, {})),
        "primary": summary.get("primary_diagnosis"), "findings": summary.get("findings", []),
        "exit_code": run.get("exit_code"),
    }
