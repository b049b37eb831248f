"""STEP_SPIKES: steps much slower than the rest, how often they come, and which phase grows."""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Optional

from traceml.collector.rollup import Window
from traceml.records import ALL_PHASES, Finding

MIN_Z = 6.0  # robust z-score (median and MAD) a step must pass to be a spike
MIN_RATIO = 2.0  # ... and it must take this many times the median step (a busy machine's
                 # jitter reaches 1.5x; the stalls worth naming are longer)
MIN_SPIKES = 3
MAJOR_SHARE = 0.25  # a spike counts when its excess is at least this share of the largest's
WARN_COST_SHARE = 0.05  # spikes costing this share of the run's time: warn (below: info)
PERIODIC_SHARE = 0.6  # this share of the gaps between spikes equal: a period

ACTIONS = {
    "outside": ("A periodic task between steps (checkpointing, evaluation, logging) stalls "
                "training: make it asynchronous or run it less often."),
    "untraced": ("Work inside the step that runs only sometimes (a synchronous checkpoint save, "
                 "metrics, a .item() sync) stalls it: move it out of the step, make it "
                 "asynchronous, or run it less often."),
    "input_wait": ("The DataLoader stalls now and then (a worker restarting each epoch, a slow "
                   "shard, an uneven file): use persistent_workers=True, a larger "
                   "prefetch_factor, and look for unusually slow samples."),
    "gc": ("Full garbage collections stall the step: gc.freeze() after setup, or collect "
           "explicitly every N steps at a moment of your choosing."),
}
DEFAULT_ACTION = ("Some steps do much more {phase} work than others: look for inputs that vary "
                  "in size (bucket by length) or work that happens only every few steps.")


def step_spikes(window: Window) -> Optional[Finding]:
    steps = window.steps
    if len(steps) < 10:
        return None
    times = [s.step_ms for s in steps]
    median = statistics.median(times)
    mad = statistics.median(abs(t - median) for t in times) or median * 0.01
    candidates = [s for s in steps if 0.6745 * (s.step_ms - median) / mad > MIN_Z
                  and s.step_ms > MIN_RATIO * median]
    if not candidates:
        return None
    # Short steps have jittery hiccups too: the spikes that matter are those of the same
    # order as the largest one; smaller ones would blur the period.
    largest = max(s.step_ms for s in candidates) - median
    spikes = [s for s in candidates if s.step_ms - median >= MAJOR_SHARE * largest]
    if len(spikes) < MIN_SPIKES:
        return None
    normal = [s for s in steps if s not in spikes]
    cost_ms = sum(s.step_ms - median for s in spikes)
    cost_share = cost_ms / window.total_ms if window.total_ms else 0.0
    # The phase that grows in a spike, against the same phase in ordinary steps.
    growth = {name: statistics.median(getattr(s, f"{name}_ms") for s in spikes)
              - statistics.median(getattr(s, f"{name}_ms") for s in normal) for name in ALL_PHASES}
    phase = max(growth, key=growth.get)
    gaps = [b.step - a.step for a, b in zip(spikes, spikes[1:])]
    period = None
    if gaps:
        gap, count = Counter(gaps).most_common(1)[0]
        if count >= PERIODIC_SHARE * len(gaps):
            period = gap
    if period is None and cost_share < WARN_COST_SHARE:
        return None  # a few irregular hiccups that cost little: noise, not a finding
    when = f"every {period} steps" if period else f"{len(spikes)} times, irregularly"
    spike_ms = statistics.median(s.step_ms for s in spikes)
    return Finding(
        kind="STEP_SPIKES", severity="warn" if cost_share >= WARN_COST_SHARE else "info",
        summary=(f"{len(spikes)} steps take {spike_ms:.1f} ms against a median of {median:.1f} ms, "
                 f"{when}; {phase.replace('_', ' ')} grows by {growth[phase]:.1f} ms in them; "
                 f"they cost {cost_share:.0%} of the run's time"),
        action=ACTIONS.get(phase, DEFAULT_ACTION.format(phase=phase)),
        evidence={"spikes": len(spikes), "period_steps": period, "phase": phase,
                  "phase_growth_ms": round(growth[phase], 3), "spike_median_ms": round(spike_ms, 3),
                  "step_median_ms": round(median, 3), "share": round(cost_share, 4),
                  "first_spike_step": spikes[0].step})
