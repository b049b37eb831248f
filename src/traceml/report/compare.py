"""`traceml compare RUN_A RUN_B`: did the change help? Phase by phase, with a verdict decided by
bootstrap confidence intervals on the per-step medians, the change in diagnosis and what else
differs between the two runs.

The verdict reads the 95% interval of the relative change in median step time (B against A):
entirely below zero: IMPROVEMENT; entirely above: REGRESSION; otherwise, inside
±EQUIVALENCE_MARGIN: EQUIVALENT (any change is too small to matter), else INCONCLUSIVE (the runs
are too short or too noisy to tell). Steps are resampled in blocks (a moving-block bootstrap),
since neighbouring steps are not independent (analysis/bootstrap.py).
"""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from traceml import rundir
from traceml.analysis.bootstrap import CONFIDENCE, block_resample, evenly, interval
from traceml.records import ALL_PHASES

EQUIVALENCE_MARGIN = 0.05  # an interval within 5% of the step either way: no change that matters
RESAMPLES = 2000
PHASE_RESAMPLES = 500


class ComparedRun:
    """One side of a comparison: its summary, and its measured steps' times per phase."""

    def __init__(self, label: str, summary: Dict[str, Any], steps: Dict[str, List[float]]):
        self.label, self.summary, self.steps = label, summary, steps

    @classmethod
    def load(cls, path: Path) -> "ComparedRun":
        """A run directory, or a final_summary.json (with its store beside it when there is one)."""
        run_dir = path if path.is_dir() else path.parent
        summary_path = path if path.is_file() else run_dir / rundir.SUMMARY_JSON
        store_path = run_dir / rundir.STORE_NAME
        steps: Dict[str, List[float]] = {}
        summary: Optional[Dict[str, Any]] = None
        if summary_path.is_file():
            summary = json.loads(summary_path.read_text())
        if store_path.is_file():
            from traceml.collector.store import Store
            from traceml.report.summary import RunData, RunFacts, build_summary

            store = Store(str(store_path), readonly=True)
            try:
                data = RunData(store)
                if summary is None:
                    summary = build_summary(data, RunFacts.from_store(store))
                steps = {name: [getattr(s, f"{name}_ms") for s in data.window.steps]
                         for name in ("step",) + ALL_PHASES}
            finally:
                store.close()
        if summary is None:
            raise FileNotFoundError(f"{path}: no {rundir.SUMMARY_JSON} or {rundir.STORE_NAME} there")
        return cls(str(path), summary, steps)


def compare(a: ComparedRun, b: ComparedRun, seed: int = 0) -> Dict[str, Any]:
    rng = random.Random(seed)
    step = _compare_series(a.steps.get("step", []), b.steps.get("step", []), RESAMPLES, rng,
                           a.summary["phases"]["step"]["median_ms"], b.summary["phases"]["step"]["median_ms"])
    verdict, reason = _verdict(step)
    phases = {name: _compare_series(a.steps.get(name, []), b.steps.get(name, []), PHASE_RESAMPLES, rng,
                                    a.summary["phases"][name]["median_ms"],
                                    b.summary["phases"][name]["median_ms"])
              for name in ALL_PHASES}
    for name in ALL_PHASES:
        phases[name]["share_a"] = a.summary["phases"][name]["share"]
        phases[name]["share_b"] = b.summary["phases"][name]["share"]
    return {"a": a.label, "b": b.label, "verdict": verdict, "reason": reason,
            "confidence": CONFIDENCE, "equivalence_margin": EQUIVALENCE_MARGIN,
            "step": step, "phases": phases, "diagnosis": _diagnosis(a.summary, b.summary),
            "environment": _environment(a.summary, b.summary)}


def _compare_series(a: Sequence[float], b: Sequence[float], resamples: int, rng: random.Random,
                    median_a: float, median_b: float) -> Dict[str, Any]:
    """Medians (from the summaries), their difference, and its bootstrap interval, in ms and
    relative to A (None when A's median is zero, or when per-step data is missing)."""
    result: Dict[str, Any] = {"median_a_ms": median_a, "median_b_ms": median_b,
                              "delta_ms": median_b - median_a,
                              "delta_share": (median_b - median_a) / median_a if median_a else None,
                              "ci_ms": None, "ci_share": None, "steps_a": len(a), "steps_b": len(b)}
    if len(a) < 5 or len(b) < 5:
        return result
    a, b = evenly(a), evenly(b)
    low, high = interval(sorted(statistics.median(block_resample(b, rng)) - statistics.median(block_resample(a, rng))
                                for _ in range(resamples)))
    result["ci_ms"] = [low, high]
    if median_a:
        result["ci_share"] = [low / median_a, high / median_a]
    return result


def _verdict(step: Dict[str, Any]) -> Tuple[str, str]:
    interval = step["ci_share"]
    if interval is None:
        return "INCONCLUSIVE", ("no per-step data to resample (a summary file without its "
                                "telemetry.sqlite, or fewer than 5 measured steps)")
    low, high = interval
    span = f"{CONFIDENCE:.0%} interval of the change in median step: {low:+.1%} to {high:+.1%}"
    if high < 0:
        return "IMPROVEMENT", f"{span}: B is faster"
    if low > 0:
        return "REGRESSION", f"{span}: B is slower"
    if -EQUIVALENCE_MARGIN <= low and high <= EQUIVALENCE_MARGIN:
        return "EQUIVALENT", f"{span}: no change beyond ±{EQUIVALENCE_MARGIN:.0%}"
    return "INCONCLUSIVE", f"{span}: too wide to tell; run longer or on a quieter machine"


def _diagnosis(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    kinds_a = [f["kind"] for f in a.get("findings", [])]
    kinds_b = [f["kind"] for f in b.get("findings", [])]
    primary = lambda s: (s.get("primary_diagnosis") or {}).get("kind")  # noqa: E731
    return {"primary_a": primary(a), "primary_b": primary(b),
            "gone": [k for k in kinds_a if k not in kinds_b],
            "new": [k for k in kinds_b if k not in kinds_a]}


def _environment(a: Dict[str, Any], b: Dict[str, Any]) -> List[Dict[str, Any]]:
    """What differs besides the code's speed: every row is shown, the differing ones flagged."""
    def facts(summary: Dict[str, Any]) -> Dict[str, Any]:
        run = summary.get("run", {})
        return {"argv": " ".join(run.get("argv") or []), "torch_version": run.get("torch_version"),
                "world_size": run.get("world_size"), "devices": ", ".join(run.get("devices") or []),
                "batch_size": summary.get("throughput", {}).get("samples_per_step")}
    fa, fb = facts(a), facts(b)
    return [{"field": name, "a": fa[name], "b": fb[name], "differs": fa[name] != fb[name]} for name in fa]


# -- the text ---------------------------------------------------------------------------------
