"""Rules on where step time goes: input, host-to-device copies, untraced work, compute, GC."""
from __future__ import annotations

import statistics
from typing import Callable, List, Optional

from traceml.collector.rollup import Window
from traceml.records import COMPUTE_PHASES, STEPS_FROM_TRACE_STEP, Finding

MIN_STEPS = 10
WAIT_WARN_SHARE = 0.10  # input wait or H2D at this share of step time: warn
WAIT_CRIT_SHARE = 0.20  # ... and at this share: crit
UNTRACED_WARN_SHARE = 0.30
UNTRACED_CRIT_SHARE = 0.50
COMPUTE_SHARE = 0.50  # forward + backward + optimizer at or above this share: compute-bound
GC_WARN_SHARE = 0.10  # garbage-collector pauses at this share of wall time: warn
GC_CRIT_SHARE = 0.20


def _severity(share: float, warn: float, crit: float) -> Optional[str]:
    if share >= crit:
        return "crit"
    if share >= warn:
        return "warn"
    return None


def _evidence(window: Window, share: float, phase_ms: float, **extra: object) -> dict:
    evidence = {"share": round(share, 4), "phase_mean_ms": round(phase_ms, 3),
                "step_mean_ms": round(window.step_mean_ms, 3), "steps": len(window)}
    evidence.update(extra)
    return evidence


def _of_step(what: str, share: float, phase_ms: float, window: Window) -> str:
    return f"{what} is {share:.0%} of the step: {phase_ms:.1f} ms of {window.step_mean_ms:.1f} ms"


def insufficient_data(steps_seen: int, steps_found_by: Optional[str] = None) -> Finding:
    if steps_seen == 0 and steps_found_by != STEPS_FROM_TRACE_STEP:
        # Steps were to be inferred and none were: say so, never "run longer".
        return Finding(
            kind="INSUFFICIENT_DATA", severity="info",
            summary="no training steps found: no optimizer.step() and no backward() ran while "
                    "TraceML watched",
            action="Mark the steps with one line around the body of the training loop: "
                   "`with traceml.trace_step(model):`",
            evidence={"steps": 0, "min_steps": MIN_STEPS, "found_by": steps_found_by})
    return Finding(
        kind="INSUFFICIENT_DATA", severity="info",
        summary=f"only {steps_seen} steps recorded; at least {MIN_STEPS} are needed for a verdict",
        action="Run longer (or trace more steps) before reading the breakdown as a diagnosis.",
        evidence={"steps": steps_seen, "min_steps": MIN_STEPS})


def _waiting(window: Window, phase: str, kind: str, what: str, action: str) -> Optional[Finding]:
    """A phase in which the model waits (for data, for copies): warn at 10%, crit at 20%."""
    share, wait_ms = window.share(phase), window.mean_ms(phase)
    severity = _severity(share, WAIT_WARN_SHARE, WAIT_CRIT_SHARE)
    if severity is None:
        return None
    return Finding(kind=kind, severity=severity, summary=_of_step(what, share, wait_ms, window),
                   action=action, evidence=_evidence(window, share, wait_ms))


def input_bound(window: Window) -> Optional[Finding]:
    return _waiting(
        window, "input_wait", "INPUT_BOUND", "input wait",
        "The model waits for the DataLoader. Raise num_workers, set pin_memory=True and "
        "persistent_workers=True, and move heavy per-sample work (decoding, tokenizing, "
        "augmenting) out of __getitem__ or cache its result.")


def h2d_bound(window: Window) -> Optional[Finding]:
    return _waiting(
        window, "h2d", "H2D_BOUND", "host-to-device copying",
        "Pin host memory (DataLoader pin_memory=True) and copy with "
        ".to(device, non_blocking=True); send compact dtypes (uint8, bf16) and convert on the "
        "device; keep tensors that do not change on the device across steps.")


def untraced_work(window: Window) -> Optional[Finding]:
    outside_share, untraced_share = window.share("outside"), window.share("untraced")
    # GC pauses land in whatever phase they interrupt, most often the unexplained time; they
    # have a rule of their own, so they are not counted here twice.
    share = max(0.0, outside_share + untraced_share - window.share("gc"))
    severity = _severity(share, UNTRACED_WARN_SHARE, UNTRACED_CRIT_SHARE)
    if severity is None:
        return None
    work_ms = max(0.0, window.mean_ms("outside", "untraced") - window.mean_ms("gc"))
    if outside_share >= untraced_share:
        where = (f"{outside_share:.0%} is between steps (outside the trace_step block)")
        action = ("Look at the code between steps: log and compute metrics every N steps, not "
                  "every step; avoid .item()/.cpu() syncs; run evaluation and checkpoints less "
                  "often or asynchronously.")
    else:
        where = (f"{untraced_share:.0%} is inside the step but outside forward, backward and "
                 "the optimizer")
        action = ("Look at the code inside the step around the model call: a loss or metric "
                  "computed outside the model, gradient clipping, manual all-reduces or .item() "
                  "syncs. Pass the model to trace_step(model) so its forward is timed.")
    return Finding(
        kind="UNTRACED_WORK", severity=severity,
        summary=(f"{_of_step('work outside forward, backward and optimizer', share, work_ms, window)}"
                 f"; {where}"),
        action=action,
        evidence=_evidence(window, share, work_ms, outside_share=round(outside_share, 4),
                           untraced_share=round(untraced_share, 4)))


def compute_bound(window: Window) -> Optional[Finding]:
    share, compute_ms = window.share(*COMPUTE_PHASES), window.mean_ms(*COMPUTE_PHASES)
    if share < COMPUTE_SHARE:
        return None
    parts = ", ".join(f"{name} {window.phases[name].share:.0%}" for name in COMPUTE_PHASES)
    return Finding(
        kind="COMPUTE_BOUND", severity="info",
        summary=f"{_of_step('model compute', share, compute_ms, window)} ({parts})",
        action=("The model's own compute dominates, as it should. To go faster: mixed precision "
                "(torch.autocast with bf16), torch.compile, a fused optimizer (fused=True), or a "
                "larger batch while memory allows."),
        evidence=_evidence(window, share, compute_ms, **{
            f"{name}_share": round(window.phases[name].share, 4) for name in COMPUTE_PHASES}))


def gc_pressure(window: Window) -> Optional[Finding]:
    share, gc_ms = window.share("gc"), window.mean_ms("gc")
    severity = _severity(share, GC_WARN_SHARE, GC_CRIT_SHARE)
    if severity is None:
        return None
    steps = window.steps
    collections = sum(s.gc_collections for s in steps) / len(steps)
    mean_pauses = [s.gc_ms / s.gc_collections for s in steps if s.gc_collections]
    median_pause = statistics.median(mean_pauses) if mean_pauses else 0.0
    worst_pause = max(s.gc_max_pause_ms for s in steps)
    total_gc_ms = sum(s.gc_ms for s in steps)
    full_share = sum(s.gc_gen2_ms for s in steps) / total_gc_ms if total_gc_ms else 0.0
    return Finding(
        kind="GC_PRESSURE", severity=severity,
        summary=(f"{_of_step('garbage collection', share, gc_ms, window)}; "
                 f"{collections:.1f} collections a step, median pause {median_pause:.1f} ms, "
                 f"worst {worst_pause:.1f} ms; full (generation 2) collections take "
                 f"{full_share:.0%} of it"),
        action=("Call gc.freeze() once the model and data are built, so the collector stops "
                "walking them; remove gc.collect() from the loop, or run it every N steps; "
                "allocate fewer short-lived Python objects per step (or raise "
                "gc.set_threshold)."),
        evidence=_evidence(window, share, gc_ms, collections_per_step=round(collections, 2),
                           median_pause_ms=round(median_pause, 3),
                           worst_pause_ms=round(worst_pause, 3),
                           full_collection_share=round(full_share, 4)))


RULES: List[Callable[[Window], Optional[Finding]]] = [input_bound, h2d_bound, untraced_work,
                                                      compute_bound, gc_pressure]
