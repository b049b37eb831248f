"""Rules on where step time goes: input, host-to-device copies, untraced work, compute, GC."""
from __future__ import annotations

import statistics
from typing import Callable, Optional, Sequence, Tuple

from traceml.analysis.loaders import LoaderFigures
from traceml.analysis.rollup import Window
from traceml.diagnose.untimed import named, part_shares, sites_evidence, sites_text
from traceml.records import (COMPUTE_PHASES, Evidence, EvidenceFigure, STEPS_FROM_BACKWARD, STEPS_FROM_OPTIMIZER,
                             STEPS_FROM_TRACE_STEP, CodeSample, Finding, FindingKind, Severity)
from traceml.words import counted, rounded_parts

MIN_STEPS = 10
WAIT_WARN_SHARE = 0.10  # input wait or H2D at this share of step time: warn
WAIT_CRIT_SHARE = 0.20  # ... and at this share: crit
UNTRACED_WARN_SHARE = 0.30
UNTRACED_CRIT_SHARE = 0.50
COMPUTE_SHARE = 0.50  # forward + backward + optimizer at or above this share: compute-bound
GC_WARN_SHARE = 0.10  # garbage-collector pauses at this share of wall time: warn
GC_CRIT_SHARE = 0.20
# A share's interval sees the noise inside one run, not the machine's drift between runs: on
# this project's shared 2-core VM one loop's input wait was 4%, 11% and 8% of its step in three
# runs (tests/field/char_transformer.py), each interval under a point wide. So a waiting phase is
# the verdict only once its share clears its warn line by this much (12.5% for the 10% line) and
# its interval stays above the line less this much (7.5%); short of that, one whose interval
# reaches 7.5% is at the line: told, not the verdict.
LINE_MARGIN = 0.25
# INPUT_BOUND's advice follows the DataLoader's figures (analysis/loaders.py). Workers that keep
# up leave a batch made and waiting in nearly every reading (all of them, in the hand-over runs of
# tests/field/char_transformer.py); fewer, and they keep up only now and then.
READY_SHARE = 0.8
# Workers that fall behind wanting a CPU (on one, or waiting for one) this share of their time or
# more: their per-sample work bounds them; less, and they wait on something else (files, network).
WORKERS_BUSY_SHARE = 0.5
WORKERS_CPU_WAIT_SHARE = 0.2  # waiting for a CPU this share of their time or more: the cores are taken
# A batch made in less than this costs about as much to hand over from a worker process (through
# shared memory and the workers' queue) as to make: on this project's VM a cheap batch took 0.4-0.5
# ms from next() without workers and 2.0-3.7 ms with 2 (tests/field/char_transformer.py).
CHEAP_BATCH_MS = 1.0
CHEAP_BATCH_FACTOR = 3  # a batch costing up to this many hand-overs to make gains nothing from workers
SMALL_BATCH = 32  # samples: a worker's fixed cost of a hand-over weighs on batches this small


def _severity(share: float, warn: float, crit: float) -> Optional[str]:
    if share >= crit:
        return Severity.CRIT
    if share >= warn:
        return Severity.WARN
    return None


def _severity_clear_of_the_line(window: Window, phase: str, warn: float, crit: float) -> Tuple[
        Optional[str], Optional[Tuple[float, float]]]:
    """A waiting phase's severity, and its share's 95% interval (analysis/bootstrap.py). The
    verdict (warn, or crit from the crit line) needs both: the share above the warn line by
    LINE_MARGIN (for the machine's drift between runs) and its whole interval above the line less
    LINE_MARGIN (for the noise inside this run: a short run on a busy machine), so that a share
    sitting on the line gives the same verdict run after run. Short of that, a share whose
    interval reaches the line less LINE_MARGIN is "info" (told, under Also, never the verdict);
    one further below, no finding."""
    # Rounded: 0.1 * 1.25 is 0.125 to the reader, 0.12500000000000003 to the float.
    above, below = round(warn * (1 + LINE_MARGIN), 6), round(warn * (1 - LINE_MARGIN), 6)
    share = window.share(phase)
    if share < below / 2:  # far below: no interval needed
        return None, None
    low, high = window.share_interval(phase)
    if share >= above and low >= below:
        return (Severity.CRIT if share >= crit else Severity.WARN), (low, high)
    return (Severity.INFO if high >= below else None), (low, high)


def _evidence(window: Window, share: float, phase_ms: float, **extra: EvidenceFigure) -> Evidence:
    evidence: Evidence = {"share": round(share, 4), "phase_mean_ms": round(phase_ms, 3),
                "step_mean_ms": round(window.step_mean_ms, 3), "steps": len(window)}
    evidence.update(extra)
    return evidence


def _of_step(what: str, share: float, phase_ms: float, window: Window) -> str:
    return f"{what} is {share:.0%} of the step: {phase_ms:.1f} ms of {window.step_mean_ms:.1f} ms"


def insufficient_data(steps_seen: int, steps_found_by: Optional[str] = None) -> Finding:
    if steps_seen == 0 and steps_found_by != STEPS_FROM_TRACE_STEP:
        # Steps were to be inferred and none were: say so, never "run longer".
        return Finding(
            kind=FindingKind.INSUFFICIENT_DATA, severity=Severity.INFO,
            summary="no training steps found: no optimizer.step() and no backward() ran while "
                    "TraceML watched",
            action="Mark the steps with one line around the body of the training loop: "
                   "`with traceml.trace_step(model):`",
            evidence={"steps": 0, "min_steps": MIN_STEPS, "found_by": steps_found_by})
    return Finding(
        kind=FindingKind.INSUFFICIENT_DATA, severity=Severity.INFO,
        summary=f"only {counted(steps_seen, 'step')} recorded; at least {MIN_STEPS} are needed for a verdict",
        action="Run longer (or trace more steps) before reading the breakdown as a diagnosis.",
        evidence={"steps": steps_seen, "min_steps": MIN_STEPS})


def _waiting(window: Window, phase: str, kind: str, what: str,
             advise: Callable[[], Tuple[str, str, Evidence]]) -> Optional[Finding]:
    """A phase in which the model waits (for data, for copies): warn from 10% and crit from 20%,
    read as _severity_clear_of_the_line says. advise(), asked only when there is a finding:
    what the wait is, in words ("" when nothing more is known), what to do, and its evidence."""
    severity, interval = _severity_clear_of_the_line(window, phase, WAIT_WARN_SHARE, WAIT_CRIT_SHARE)
    if severity is None or interval is None:
        return None
    share, wait_ms = window.share(phase), window.mean_ms(phase)
    summary = _of_step(what, share, wait_ms, window)
    lines = {"line": WAIT_WARN_SHARE, "verdict_share": round(WAIT_WARN_SHARE * (1 + LINE_MARGIN), 6),
             "verdict_low_share": round(WAIT_WARN_SHARE * (1 - LINE_MARGIN), 6), "interval_level": 0.95}
    if severity == Severity.INFO:
        summary += (f", at the {lines['line']:.0%} line ({lines['interval_level']:.0%} interval {interval[0]:.1%} to "
                    f"{interval[1]:.1%}; {lines['verdict_share']:.1%} needed, the interval "
                    f"above {lines['verdict_low_share']:.1%}): too close to call the run bound by it")
    cause, action, cause_evidence = advise()
    if cause:
        summary += f"; {cause}"
    evidence = _evidence(window, share, wait_ms, share_low=round(interval[0], 4),
                         share_high=round(interval[1], 4), **lines, **cause_evidence)
    return Finding(kind=kind, severity=severity, summary=summary, action=action, evidence=evidence)


INPUT_ACTION = ("The model waits for the DataLoader. Raise num_workers and move heavy per-sample work "
                "(decoding, tokenizing, augmenting) out of __getitem__ or cache its result.")
PIN_ACTION = " Set pin_memory=True and copy with .to(device, non_blocking=True)."


def input_bound(window: Window, loader: Optional[LoaderFigures] = None) -> Optional[Finding]:
    """INPUT_BOUND, with what to do about it read from the training DataLoader's figures (None:
    none were measured, as in traceml.summary() inside the training process)."""

    def advise() -> Tuple[str, str, Evidence]:
        if loader is None:  # pinning only helps batches bound for an accelerator
            return "", INPUT_ACTION + (PIN_ACTION if any(s.device_timed for s in window.steps) else ""), {}
        batches = loader.batches_per_step or 1.0
        wait_ms = window.mean_ms("input_wait") / batches
        work_ms = window.step_mean_ms / batches - wait_ms  # the training's own time a batch
        cause, action, code = loader_advice(loader, wait_ms, work_ms)
        return (f"{describe_loader(loader)}: {cause}", action,
                {**loader.evidence(), "input_wait_ms_per_batch": round(wait_ms, 3),
                 "training_ms_per_batch": round(work_ms, 3), "loader_cause": code})

    return _waiting(window, "input_wait", FindingKind.INPUT_BOUND, "input wait", advise)


def describe_loader(loader: LoaderFigures) -> str:
    """The DataLoader as it was set up: "DataLoader(num_workers=2, ...) training on cpu"."""
    settings = [f"num_workers={loader.num_workers}"]
    if loader.on_accelerator:
        settings.append(f"pin_memory={loader.pin_memory}")
    if loader.num_workers:
        settings += [f"persistent_workers={loader.persistent_workers}", f"prefetch_factor={loader.prefetch_factor}"]
    if loader.batch_size is not None:
        settings.append(f"batch_size={loader.batch_size}")
    where = f"on {loader.device}" if loader.on_accelerator else "on the CPU (no accelerator: pin_memory pins nothing)"
    thread = " iterated on a thread ahead of the training," if loader.thread_ms_per_batch is not None else ""
    return f"DataLoader({', '.join(settings)}){thread} training {where}"


def loader_advice(loader: LoaderFigures, wait_ms: float, work_ms: float) -> Tuple[str, str, str]:
    """What the DataLoader's figures say the wait is, what can help there, and a code for the
    cause (the evidence's loader_cause): thread_behind, thread_held_up, no_workers, handover,
    near_handover, per_sample_work, waiting_workers, or unmeasured. wait_ms: the training's input
    wait per batch; work_ms: the rest of its step per batch. Batches made in worker processes
    are read from the workers' figures, wherever the iterator runs; without workers, from the
    thread that makes them."""
    cost_ms, ready, busy = loader.worker_cpu_ms_per_batch, loader.ready_share, loader.workers_busy_share
    if loader.num_workers == 0 and loader.thread_ms_per_batch is not None:
        cause, action, code = _on_thread(loader.thread_ms_per_batch, wait_ms, work_ms)
    elif loader.num_workers == 0:
        cause, action, code = _without_workers(loader, wait_ms)
    elif ready is None or cost_ms is None or busy is None:
        cause, action, code = (f"each batch takes {wait_ms:.1f} ms to arrive (too few batches to tell why)", (
            "Check the per-sample cost of __getitem__ and the collate before adding workers; if batches "
            "are cheap to make, compare against num_workers=0 (`traceml compare`): a worker's hand-over of "
            f"a batch costs about {CHEAP_BATCH_MS:.0f} ms."), "unmeasured")
    elif ready >= READY_SHARE:
        cause, action, code = _handover(loader, wait_ms, cost_ms, ready)
    else:
        cause, action, code = _behind(loader, cost_ms, ready, busy, loader.workers_cpu_wait_share or 0.0)
    return cause, action + _loader_settings_advice(loader, code), code


def _behind(loader: LoaderFigures, cost_ms: float, ready: float, busy: float,
            cpu_wait: float) -> Tuple[str, str, str]:
    """The workers do not keep up: on the CPU (or waiting for one), their per-sample work bounds
    the input; off it, they wait on something else."""
    behind = (f"its {loader.num_workers} workers fall behind (a batch was waiting made in {ready:.0%} of "
              "readings)")
    if busy + cpu_wait < WORKERS_BUSY_SHARE:
        return (f"{behind} while on the CPU only {busy:.0%} of their time: they wait on something else, "
                "such as reading files, the network or a lock"), (
            "More workers overlap that waiting (they need little CPU); read from faster or local storage, "
            "or cache what is read."), "waiting_workers"
    cause = (f"{behind}, on a CPU {busy:.0%} of their time and waiting for one {cpu_wait:.0%}, "
             f"{cost_ms:.1f} ms of CPU a batch: the per-sample work bounds the input")
    if cpu_wait >= WORKERS_CPU_WAIT_SHARE:
        action = ("The cores are taken (by the training's own threads, the other workers, other processes): "
                  "more workers will not help")
    elif loader.num_workers < loader.usable_cores - 1:  # one core left for the training itself
        action = (f"Raise num_workers ({loader.num_workers} workers on {loader.usable_cores} cores this "
                  "process may use)")
    else:
        action = f"The workers already fill the cores ({loader.num_workers} workers on {loader.usable_cores})"
    return cause, action + ("; make __getitem__ cheaper: cache decoded samples, tokenize ahead of time, "
                            "vectorize the collate."), "per_sample_work"


def _on_thread(thread_ms: float, wait_ms: float, work_ms: float) -> Tuple[str, str, str]:
    """Batches made on a thread ahead of the training (a prefetcher): it keeps up when it makes
    a batch in no more time than the training spends on one."""
    made = f"a thread makes each batch in {thread_ms:.1f} ms"
    if thread_ms > work_ms:
        return (f"{made}, more than the {work_ms:.1f} ms the training spends on one: the thread falls behind", (
            "Make the batches in worker processes (num_workers on the DataLoader the thread iterates: MONAI's "
            "ThreadDataLoader passes it on), or make each batch cheaper: cache decoded samples, tokenize ahead "
            "of time, vectorize the collate."), "thread_behind")
    return (f"{made}, within the {work_ms:.1f} ms the training spends on one, yet each takes {wait_ms:.1f} ms to "
            "arrive: the thread is held up (by the training's own Python, or by the cores) or its buffer runs dry", (
                "Let the thread run further ahead (a larger buffer: ThreadDataLoader's buffer_size, the queue's "
                "maxsize), or make the batches in worker processes (num_workers), which do not share the "
                "training's interpreter."), "thread_held_up")


def _without_workers(loader: LoaderFigures, wait_ms: float) -> Tuple[str, str, str]:
    cause = f"with no workers each batch is made on the training thread, {wait_ms:.1f} ms a batch"
    if wait_ms < CHEAP_BATCH_MS:
        action = (f"Batches this cheap gain little from worker processes, whose hand-over of a batch costs "
                  f"about {CHEAP_BATCH_MS:.0f} ms: make the step do more per batch (a larger batch), or the "
                  "batch cheaper to build (index a tensor rather than stacking samples one by one).")
    elif loader.usable_cores <= 1:
        action = ("This process may run on one core: worker processes would take turns with the training "
                  "rather than overlap it. Make __getitem__ cheaper or cache its result.")
    else:
        action = (f"Set num_workers (this process may use {loader.usable_cores} cores) so that batches are "
                  "made while the model runs, and move heavy per-sample work (decoding, tokenizing, "
                  "augmenting) out of __getitem__ or cache its result.")
    return cause, action, "no_workers"


def _handover(loader: LoaderFigures, wait_ms: float, cost_ms: float, ready: float) -> Tuple[str, str, str]:
    """The workers keep up (a batch is usually waiting made), yet the training waits for each:
    what it waits for is the hand-over from the worker processes."""
    seen = f"a batch was waiting made in {ready:.0%} of readings"
    if wait_ms > cost_ms:
        cause = (f"{seen}, yet each takes {wait_ms:.1f} ms to arrive, more than the {cost_ms:.1f} ms of CPU "
                 "a worker spends making it: the wait is the hand-over from the worker processes "
                 "(pickling, shared memory, queues), and a batch costs more with workers than without")
        cpu_wait = loader.workers_cpu_wait_share or 0.0
        if cpu_wait >= WORKERS_CPU_WAIT_SHARE:  # a worker waiting for a core hands over late
            cause += f" (the workers wait for a CPU {cpu_wait:.0%} of their time: the cores are taken)"
        action = ("Use fewer workers or num_workers=0 (compare the two runs with `traceml compare`), or "
                  "larger batches, so that each hand-over carries more samples.")
        return cause, action, "handover"
    cause = (f"{seen}, and each takes {wait_ms:.1f} ms to arrive, close to what handing a batch over from a "
             "worker costs")
    small = (f" and, with batches this small ({loader.batch_size} samples), the workers' overhead: larger "
             "batches spread it" if loader.batch_size is not None and loader.batch_size <= SMALL_BATCH else "")
    if cost_ms <= CHEAP_BATCH_FACTOR * CHEAP_BATCH_MS:
        # A batch that costs about a hand-over to make: more workers add hand-overs, not batches.
        action = ("Compare fewer workers or num_workers=0 against this run (`traceml compare`) before adding "
                  f"any: a batch costs {cost_ms:.1f} ms of worker CPU to make, about what its hand-over costs"
                  + small + ".")
    else:
        action = f"Before adding workers, check the per-sample cost ({cost_ms:.1f} ms of worker CPU a batch)" + small + "."
    return cause, action, "near_handover"


def _loader_settings_advice(loader: LoaderFigures, code: str) -> str:
    """pin_memory and persistent_workers, only where they can help: pinning when batches go to
    an accelerator unpinned (not where the hand-over is the wait: pinning adds to it), and
    keeping the workers when they were started again for each epoch."""
    advice = ""
    if loader.on_accelerator and not loader.pin_memory and code not in ("handover", "near_handover"):
        advice += PIN_ACTION
    if loader.num_workers and not loader.persistent_workers and loader.iterators_made > 1:
        advice += (f" persistent_workers=True keeps the workers between epochs ({loader.iterators_made} "
                   "started their workers afresh).")
    return advice


H2D_ACTION = ("Pin host memory (DataLoader pin_memory=True) and copy with .to(device, non_blocking=True); "
              "send compact dtypes (uint8, bf16) and convert on the device; keep tensors that do not "
              "change on the device across steps.")


def h2d_bound(window: Window) -> Optional[Finding]:
    return _waiting(window, "h2d", FindingKind.H2D_BOUND, "host-to-device copying", lambda: ("", H2D_ACTION, {}))


def untraced_work(window: Window, steps_found_by: Optional[str] = None,
                  code: Sequence[CodeSample] = ()) -> Optional[Finding]:
    """UNTRACED_WORK: time outside the timed phases, in the step or between steps, with the
    code it was sampled in (diagnose/untimed.py) where the probe sampled it."""
    outside_share, untraced_share = window.share("outside"), window.share("untraced")
    # GC pauses land in this time too; they have a finding of their own, so they are not
    # counted here twice (evaluation and saves are never in a step's time).
    named_share = window.share("gc")
    share = max(0.0, outside_share + untraced_share - named_share)
    severity = _severity(share, UNTRACED_WARN_SHARE, UNTRACED_CRIT_SHARE)
    if severity is None:
        return None
    work_ms = share * window.step_mean_ms
    between = outside_share >= untraced_share
    where, action = _where_and_what_to_do(between, steps_found_by, outside_share, untraced_share)
    part = "outside" if between else "untraced"
    sites = named(code, part, part_shares(window)[part])
    if sites:
        where += f": {sites_text(sites)}"
        action = f"Start with {sites[0]['where']}. {action}"
    return Finding(
        kind=FindingKind.UNTRACED_WORK, severity=severity,
        summary=(f"{_of_step('work outside forward, backward and optimizer', share, work_ms, window)}"
                 f"; {where}"),
        action=action,
        evidence=_evidence(window, share, work_ms, outside_share=round(outside_share, 4),
                           untraced_share=round(untraced_share, 4), **sites_evidence(sites, "share")))


TRAINERS_ACTION = ("A step this short is mostly the trainer's own fixed cost: give each update "
                   "more work (a larger batch, or gradient accumulation), log less often "
                   "(logging_steps, log_every_n_steps), drop callbacks you do not need and turn off "
                   "the progress bar.")


def _where_and_what_to_do(between: bool, steps_found_by: Optional[str], outside_share: float,
                          untraced_share: float) -> Tuple[str, str]:
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
    # The collectives' wait inside forward and backward is the other ranks' and the wire's, not
    # this model's compute (COMM_BOUND and the straggler rules tell it).
    comm = window.comm_wait
    share = window.share(*COMPUTE_PHASES) - comm.share
    compute_ms = window.mean_ms(*COMPUTE_PHASES) - comm.mean_ms
    if share < COMPUTE_SHARE and not healthy:
        return None
    # In whole percents that add up to the share said: the collectives' wait is taken off.
    phase_shares = [window.phases[name].share for name in COMPUTE_PHASES] + ([-comm.share] if comm.share > 0 else [])
    percents = rounded_parts([100 * part for part in phase_shares], 0)
    parts = ", ".join(f"{name} {percent:.0f}%" for name, percent in zip(COMPUTE_PHASES, percents))
    if comm.share > 0:
        parts += f", less {-percents[-1]:.0f}% waiting in collectives"
    return Finding(
        kind=FindingKind.COMPUTE_BOUND, severity=Severity.INFO,
        summary=f"{_of_step('model compute', sum(percents) / 100, compute_ms, window)} ({parts})",
        action=("The model's own compute dominates, as it should. To go faster: mixed precision "
                "(torch.autocast with bf16), torch.compile, a fused optimizer (fused=True), or a "
                "larger batch while memory allows."),
        evidence=_evidence(window, share, compute_ms, comm_wait_share=round(comm.share, 4), **{
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
        kind=FindingKind.GC_PRESSURE, severity=severity,
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


