"""Diagnosis: pure rules over a window of rolled-up steps, producing ranked Findings.

The same functions give the live alerts and the final verdict. A rule takes a Window (and how
many steps the run had) and returns a Finding or None; `diagnose` runs them all and orders the
findings so the first is the primary diagnosis.
"""
from __future__ import annotations

from typing import List, Optional

from traceml.collector.rollup import Window
from traceml.diagnose.memory import MemoryLimits, memory_creep, memory_pressure, out_of_memory
from traceml.diagnose.spikes import step_spikes
from traceml.diagnose.step_time import MIN_STEPS, RULES, insufficient_data
from traceml.diagnose.stragglers import straggler
from traceml.records import Finding, OomRecord

SEVERITY_ORDER = {"crit": 0, "warn": 1, "info": 2}


def diagnose(window: Window, steps_seen: int, ranks: Optional[List[dict]] = None,
             limits: Optional[MemoryLimits] = None, peak_device_bytes: Optional[int] = None,
             peak_rss_bytes: Optional[int] = None, oom: Optional[OomRecord] = None,
             layers_alive: Optional[List[dict]] = None,
             steps_found_by: Optional[str] = None) -> List[Finding]:
    """Every finding for this window, most severe and most costly first.

    ranks: per-rank medians (rollup.rank_medians) when there are several; limits and peaks:
    what memory there is and what the run reached; oom: the step that ran out of memory;
    steps_found_by: how steps were found (records.STEPS_FROM_*), for a run that found none.
    """
    limits = limits or MemoryLimits()
    findings: List[Finding] = [out_of_memory(oom, limits)] if oom is not None else []
    if steps_seen < MIN_STEPS:
        return findings + [insufficient_data(steps_seen, steps_found_by)]
    findings += [finding for rule in RULES if (finding := rule(window)) is not None]
    found = [step_spikes(window), memory_creep(window, limits, layers_alive)]
    if oom is None:  # the post-mortem already says how full memory was
        found.append(memory_pressure(window, limits, peak_device_bytes, peak_rss_bytes))
    if ranks:
        found.append(straggler(ranks, window.step_median_ms))
    findings += [finding for finding in found if finding is not None]
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -float(f.evidence.get("share") or 0.0)))
    return findings


__all__ = ["diagnose", "Finding", "MemoryLimits", "SEVERITY_ORDER"]
