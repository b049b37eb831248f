"""Rules on where step time goes: input, host-to-device copies, untraced work, compute, GC."""
from __future__ import annotations

import statistics
from typing import Optional

from traceml.analysis.rollup import Window
from traceml.records import (COMPUTE_PHASES, STEPS_FROM_BACKWARD, STEPS_FROM_OPTIMIZER,
                             STEPS_FROM_TRACE_STEP, Finding)
from traceml.words import counted

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
        summary=f"only {counted(steps_seen, 'step')} recorded; at least {MIN_STEPS} are needed for a verdict",
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


def untraced_work(window: Window, steps_found_by: Optional[str] = None) -> Optional[Finding]:
    outside_share, untraced_share = window.share("outside"), window.share("untraced")
    # GC pauses, evaluation and checkpoint saves land in this time too; they have findings of
    # their own, so they are not counted here twice.
    named_share = window.share("gc") + window.planned_share("eval") + window.planned_share("checkpoint")
    share = max(0.0, outside_share + untraced_share - named_share)
    severity = _severity(share, UNTRACED_WARN_SHARE, UNTRACED_CRIT_SHARE)
    if severity is None:
        return None
    work_ms = share * window.step_mean_ms
    where, action = _where_and_what_to_do(outside_share >= untraced_share, steps_found_by,
                                          outside_share, untraced_share)
    return Finding(
        kind="UNTRACED_WORK", severity=severity,
        summary=(f"{_of_step('work outside forward, backward and optimizer', share, work_ms, window)}"
                 f"; {where}"),
        action=action,
        evidence=_evidence(window, share, work_ms, outside_share=round(outside_share, 4),
                           untraced_share=round(untraced_share, 4)))


TRAINERS_ACTION = ("A step this short is mostly the trainer's own fixed cost: give each update "
                   "more work (a larger batch, or gradient accumulation), log less often "
                   "(logging_steps, log_every_n_steps), drop callbacks you do not need and turn off "
                   "the progress bar.")


def _where_and_what_to_do(between: bool, steps_found_by: Optional[str], outside_share: float,
                          untraced_share: float) -> tuple:
    """Where the untraced time is and what to look at, in the words of how the steps were
    found: a trace_step block, steps inferred in the user's own loop, or a trainer's updates."""
    if steps_found_by not in (None, STEPS_FROM_TRACE_STEP, STEPS_FROM_OPTIMIZER, STEPS_FROM_BACKWARD):
        if between:
            return (f"{outside_share:.0%} is the trainer's own work between updates (callbacks, "
                    "logging, progress bar, evaluation)", TRAINERS_ACTION)
        return (f"{untraced_share:.0%} is inside the update but outside the model (the trainer's "
                "training step around it: the loss, logging, callbacks)", TRAINERS_ACTION)
    if between:
        if steps_found_by in (None, STEPS_FROM_TRACE_STEP):
            where = f"{outside_share:.0%} is between steps (outside the trace_step block)"
        else:
            where = f"{outside_share:.0%} is between steps (after one update, before the next step's work)"
            if steps_found_by == STEPS_FROM_BACKWARD:
                where += "; with steps found by backward(), that includes the update written by hand"
        return where, ("Look at the code between steps: log and compute metrics every N steps, not "
                       "every step; avoid .item()/.cpu() syncs; run evaluation and checkpoints less "
                       "often or asynchronously.")
    where = (f"{untraced_share:.0%} is inside the step but outside forward, backward and the "
             "optimizer")
    action = ("Look at the code inside the step around the model call: a loss or metric "
              "computed outside the model, gradient clipping, manual all-reduces or .item() syncs.")
    if steps_found_by in (None, STEPS_FROM_TRACE_STEP):
        action += " Pass the model to trace_step(model) so its forward is timed."
    return where, action


def compute_bound(window: Window, healthy: bool = False) -> Optional[Finding]:
    """The model's own compute dominates: the verdict of a healthy run. healthy: given anyway,
    as the verdict of a run in which nothing else is worth a tenth of its time."""
    share, compute_ms = window.share(*COMPUTE_PHASES), window.mean_ms(*COMPUTE_PHASES)
    if share < COMPUTE_SHARE and not healthy:
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


