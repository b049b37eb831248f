"""Diagnosis: pure rules over a window of rolled-up steps, producing ranked Findings.

The same functions give the live alerts and the final verdict. A rule takes a Window (and how
many steps the run had) and returns a Finding or None; `diagnose` runs them all and orders the
findings so the first is the primary diagnosis.
"""
from __future__ import annotations

from typing import List, Optional

from traceml.collector.rollup import Window
from traceml.diagnose.step_time import MIN_STEPS, RULES, insufficient_data
from traceml.diagnose.stragglers import straggler
from traceml.records import Finding

SEVERITY_ORDER = {"crit": 0, "warn": 1, "info": 2}


def diagnose(window: Window, steps_seen: int, ranks: Optional[List[dict]] = None) -> List[Finding]:
    """Every finding for this window (and these per-rank medians), most severe and costly first."""
    if steps_seen < MIN_STEPS:
        return [insufficient_data(steps_seen)]
    findings = [finding for rule in RULES if (finding := rule(window)) is not None]
    if ranks:
        found = straggler(ranks, window.step_median_ms)
        if found is not None:
            findings.append(found)
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -float(f.evidence.get("share") or 0.0)))
    return findings


__all__ = ["diagnose", "Finding", "SEVERITY_ORDER"]
