"""The step probe: `trace_step` splits each optimizer step into its phases on the training thread.

A step's window runs from its start to the start of the next step (the parts add up to
that wall time). So step N is closed, and its record emitted, when step N+1 starts, or when the
run ends, in which case its window closes at its own end. Inside the `with` block the probe
sums the phases the patches report (h2d, forward, backward, optimizer, input wait); the rest
of the block is `untraced`. Between blocks, DataLoader time is `input_wait`, the rest `outside`.

Everything here runs on the training thread and stays small: read a clock, add to an int,
record a pooled CUDA event. Encoding, event resolution and sending happen in the sender.
The process's one probe is made, hooked in and taken out by process.py.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from traceml.probe.ledger import FIRST_READING_STEPS
from traceml.probe.oom import is_out_of_memory, oom_record
from traceml.probe.step_state import (
    BACKWARD, CHECKPOINT_BETWEEN_NS, CHECKPOINT_NS, COMM_WAIT_NS, EVAL_NS, FAILED_PHASE, FORWARD,
    FORWARD_COMM_WAIT_NS, GC_COLLECTIONS, GC_FULL, GC_GEN0_NS, GC_MAX_NS, GC_NS, INPUT_WAIT_GAP_NS, NO_PHASE,
    OPTIMIZER, OPTIMIZER_COMM_WAIT_NS, STEP_ZEROS, WINDOW_ZEROS, ClosedStep, EndedWindow, PythonProbeState,
    SpanTotal, fast_path)
from traceml.probe.turns import OptimizerTurn
from traceml.records import STEPS_FROM_TRACE_STEP, TIMED_PHASES
from traceml.rendezvous import rank_env

log = logging.getLogger("traceml")
_now_ns = time.perf_counter_ns
_NOT_A_STEP = RuntimeError("not a step")  # ends an inferred step without a record


class StepProbe(fast_path.ProbeState if fast_path is not None else PythonProbeState):  # type: ignore[misc]
    """Per-process probe state: the step in flight, the one before it, and their clocks."""

    # Slots, not a __dict__. What a step touches on every call is the base class's (above);
    # the rest: set-up, deep-dive, inferred steps, DDP, spans, the end of the run.
    __slots__ = ("_start_event", "_phase_events", "_gradients_done_ns", "_open_event", "_gc_start_ns",
                 "device_memory", "exit_code", "_unix_at_zero_s", "_gradients_done_event", "_layers",
                 "_turn", "_optimizers_seen", "_model_wait_ends", "_evaluation_start_ns",
                 "_grad_enabled", "tail_eval_ns", "tail_checkpoint_ns", "_planned_counted",
                 "on_fault", "time_the_model_of", "stop_awaiting_models", "_syncs", "sync_due_step", "_layers_due_step",
                 "_ledger_due_step")

    def __init__(self, sender: Any, timeline: Any = None, device_memory: Any = None, host_rss: Any = None,
                 on_fault: Optional[Callable[[str], None]] = None,
                 time_the_model_of: Optional[Callable[[Any], bool]] = None,
                 stop_awaiting_models: Optional[Callable[[], None]] = None,
                 grad_enabled: Optional[Callable[[], bool]] = None, syncs: Any = None):
        """What the process around the probe does for it (process.py hands these in; a probe
        made on its own only logs and times no model): on_fault, after an internal fault, takes
        TraceML out of the training; time_the_model_of, at an optimizer's first step, times the
        model it trains (True when a model is now awaited); stop_awaiting_models, once none is,
        stops looking at each module call; grad_enabled is torch.is_grad_enabled (a forward
        without gradients starts no inferred step); syncs, the HostSyncSampler on CUDA."""
        super().__init__()
        self.sender = sender
        self.timeline = timeline  # DeviceTimeline on CUDA, None when the host clock is the device clock
        self.device_memory = device_memory
        self.host_rss = host_rss
        self.rank = rank_env()[0]
        self.exit_code: Optional[int] = None
        self.setup_started_ns = 0
        self._empty_step_state()
        # Under DDP: collective wait inside backward, see note_gradients_done.
        self.comm_timed = False
        self._gradients_done_ns, self._gradients_done_event = 0, None
        self._layers = None  # LayerProbe under deep-dive, see layers
        # The next step whose start has work to do (due_step: the first of the next steps that
        # call layers.begin_step and syncs.begin_step, each saying after each call), and whether
        # this step runs deep-dive's hooks: most steps skip all of it.
        self.due_step = self._layers_due_step = self.sync_due_step = math.inf
        self._ledger_due_step = FIRST_READING_STEPS[0] if getattr(sender, "ledger", None) else math.inf
        # The memory ledger's first reading (probe/ledger.py says when) and the sampler's first
        # sample: the syncs setter schedules both.
        self.syncs = syncs
        self.layers_active = False
        self.tail_eval_ns = self.tail_checkpoint_ns = 0  # after the last step (see finish)
        self._planned_counted: list = [None, 0, 0]  # [a window, evaluations, saves] begun in it
        self.reset_inferred_steps()
        self._grad_enabled: Callable[[], bool] = grad_enabled or _grad_always_enabled
        # True while a trainer's evaluation runs (an integration says so): timed as a whole as
        # evaluation, and its loader waits are not the training's input wait.
        self.in_evaluation, self._evaluation_start_ns = False, 0
        # The thread that made the probe (the one whose steps it times), and how deep it is in
        # timed DataLoader __next__ calls: a queue's get inside one (the pin-memory thread's) is
        # that wait already (patches/input_wait.py).
        self.training_thread, self.fetching = threading.get_ident(), 0
        # User spans, summed by name where each call ends: name -> its SpanTotal for the latest
        # step it ran in; sent as one SpanRecord per name and step (span_done, span_record).
        self.span_totals: dict = {}
        # The closed step waiting for the next start to end its window.
        self._closed: Optional[ClosedStep] = None
        # Inferred steps: the step before, its window ended at this step's start, held until
        # this one proves to be a step (see exit).
        self._unconfirmed: Optional[EndedWindow] = None
        self.on_fault: Callable[[str], None] = on_fault or _log_fault
        self.time_the_model_of: Callable[[Any], bool] = time_the_model_of or _times_no_model
        self.stop_awaiting_models: Callable[[], None] = stop_awaiting_models or _awaits_no_model

    def _empty_step_state(self) -> None:
        """No step in flight and an empty window: what the step's hot paths read and write."""
        # The step in flight: 0 between steps, else how deep trace_step blocks are nested (an
        # integration's inside a user's); the step ends when the outermost one exits.
        self.in_step = 0
        # In a step the patches may time inline, without phase_begin and phase_end (see enter).
        self.plain = False
        self.step_index = self._step_start_ns = 0
        # The update being timed: id() of the optimizer whose step opened it (0: none), its start;
        # one whose step calls another's (ZeroRedundancyOptimizer) is timed once, by the outer one.
        self._optimizer_timed = self._optimizer_start_ns = 0
        # Wall clock = this offset + perf_counter: one reading, not a time.time() per step.
        self._unix_at_zero_s = time.time() - _now_ns() / 1e9
        self._start_event: Any = None
        self.open_phase, self._open_event = NO_PHASE, None  # only a phase's outermost call is timed
        self.sums = [*STEP_ZEROS]  # the step in flight (see STEP_ZEROS)
        self._phase_events: List[Tuple[str, Any, Any]] = []
        # The window's GC pauses, evaluation and checkpoint saves (see WINDOW_ZEROS), added to
        # in place by gc_callback, the model's calls outside steps and torch.save.
        self.window = [*WINDOW_ZEROS]
        self._gc_start_ns = 0

    def reset_inferred_steps(self) -> None:
        """Off until infer_steps turns it on; also at a detach, so that the next traced region
        (fine-tuning after pretraining, with new optimizers) learns its optimizers afresh."""
        # No trace_step in the loop (zero-code mode, the Trace API): a step starts at its first
        # phase and ends when the optimizer steps, or, in a loop that no torch.optim optimizer
        # updates, when backward returns. An explicit trace_step turns this off for good.
        self.auto_steps = False
        self._turn = OptimizerTurn(self.set_steps_from, _any_optimizer_made)  # which update ends a step
        # What the hot paths read of it (the compiled ones too, in their C struct), set after
        # each update it is told of: the optimizer whose update ends a step with nothing left to
        # learn (the turn settled, no model awaited), else None; and whether an optimizer ends
        # steps at all (then backward never does).
        self._settled_optimizer: Optional[int] = None
        self._optimizer_ends_steps = False
        self._optimizers_seen: set = set()  # id() of each optimizer whose model is timed
        self._model_wait_ends: Optional[int] = None  # the step after which a model is no longer awaited

    def enter(self, now: int = 0) -> "StepProbe":
        """Start a step (now: when it started, if not now)."""
        if self.in_step:
            self.in_step += 1  # a nested trace_step (an integration inside a user's block)
            return self
        try:
            now = now or _now_ns()
            if self.setup_started_ns:
                # The first step began when trace_step was first called; the probe's own set-up
                # (imports, patches) is part of it, so even step 0 adds up to the loop's clock.
                now, self.setup_started_ns = self.setup_started_ns, 0
            timeline = self.timeline
            if timeline is not None:
                self._start_event = timeline.record()
                self._phase_events = []
                self.device_memory.reset_peak()
            closed = self._closed
            if closed is not None:
                # The step before ends its window now. The arithmetic happens on the sender's
                # thread (step_records.py).
                self._closed = None
                ending = EndedWindow(closed, now, self.window, self._start_event)
                if self.auto_steps:
                    self._unconfirmed = ending  # sent once this step proves to be one (see exit)
                else:
                    self._end_window(ending)
            self.window = [*WINDOW_ZEROS]
            self.sums = [*STEP_ZEROS]
            if self.step_index >= self.due_step:
                self._begin_due_work()
            self._step_start_ns = now
            self.in_step = 1
            # The common step: host clock, no deep-dive sample, no DDP. The compiled timers
            # then time a phase themselves (a call of phase_begin and phase_end costs about a µs
            # inside a training step, whose own work has pushed them out of the cache).
            self.plain = timeline is None and not self.layers_active and not self.comm_timed
        except Exception:  # the training comes first: a fault here costs telemetry only
            self.on_fault("trace_step enter")
        return self

    def exit(self, failed: Optional[BaseException] = None, now: int = 0) -> None:
        """End the step (failed: the exception leaving it, if any; now: when it ended, if not now)."""
        if self.in_step > 1:
            self.in_step -= 1
            return
        now = now or _now_ns()
        try:
            self.in_step = 0
            self.plain = False
            if failed is not None and is_out_of_memory(failed):
                self.sender.push(oom_record(self, failed))
            self.open_phase = NO_PHASE
            instrumented = self.layers_active  # a deep-dive sample: not the user's speed
            if instrumented:
                self.layers.end_step()
            if (failed is not None or self._unconfirmed is not None) and not self._settle_inferred(failed):
                return
            timeline = self.timeline
            if timeline is None:
                end_event = allocated = peak = reserved = None
            else:
                end_event = timeline.record()
                allocated, peak, reserved = self.device_memory.read()
            # The sender thread reads RSS (a /proc read costs the thread that makes it far more
            # than its few µs on a VM); a step takes the latest reading.
            host_rss = self.host_rss
            self._closed = ClosedStep(self.step_index, self._step_start_ns, now, self.sums, allocated, peak,
                                      reserved, self._start_event, end_event, self._phase_events,
                                      host_rss.latest_bytes if host_rss is not None else None, instrumented)
            self.step_index += 1
        except Exception:  # the training comes first: a fault here costs telemetry only
            self.on_fault("trace_step exit")

    def _begin_due_work(self) -> None:
        """A host-sync sample, a memory ledger reading, a deep-dive sample, a capture: the work
        due at this step's start."""
        if self.step_index >= self.sync_due_step:
            self.sync_due_step = self.syncs.begin_step(self.step_index)
            self._reschedule()
        if self.step_index >= self._ledger_due_step:
            self._ledger_due_step = self._read_ledger()
            self._reschedule()
        if self.step_index >= self._layers_due_step:
            self.layers.begin_step(self.step_index)  # sets layers_due_step, and so due_step, last

    def _reschedule(self) -> None:
        """due_step: the first step whose start has some work due."""
        self.due_step = min(self._layers_due_step, self.sync_due_step, self._ledger_due_step)

    def _read_ledger(self) -> float:
        """Read what holds the memory (between steps: see probe/ledger.py); the next step due."""
        ledger = getattr(self.sender, "ledger", None)
        if ledger is None:
            return math.inf
        try:
            reading, next_step = ledger.at_step_start(self.step_index, time.monotonic())
        except Exception:  # a model or optimizer it cannot read: no ledger, the rest goes on
            log.debug("traceml: memory ledger failed; it stops", exc_info=True)
            self.sender.ledger = None
            return math.inf
        if reading is not None:
            self.sender.push(reading)
        return next_step

    @property
    def syncs(self) -> Any:
        """The HostSyncSampler (on CUDA), or None."""
        return self._syncs

    @syncs.setter
    def syncs(self, sampler: Any) -> None:
        self._syncs = sampler
        self.sync_due_step = sampler.first_sample_step if sampler is not None else math.inf
        self._reschedule()

    @property
    def layers_due_step(self) -> float:
        """The next step whose start calls layers.begin_step: the LayerProbe sets it after each
        call, and the sender's thread to wake deep-dive for a capture."""
        return self._layers_due_step

    @layers_due_step.setter
    def layers_due_step(self, step: float) -> None:
        self._layers_due_step = step
        self._reschedule()

    def _settle_inferred(self, failed: Optional[BaseException]) -> bool:
        """A step that failed, or an inferred one whose predecessor waits on it: send that
        predecessor as it should end. False when this step is not a step."""
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        if failed is None:
            self._end_window(unconfirmed)  # this step proved one: the step before ends at its start
            return True
        # The step did not finish: it is not a step. Its window never closes, so the
        # previous steps keep their figures and the next step starts afresh.
        if unconfirmed is not None:
            # Inferred, the step before was waiting for this one to prove a step before
            # closing its window at its start. It did not (work after the last update, an
            # evaluation with gradients on): that step's window ends where it ended, and
            # the planned work counted since is not its.
            closed = unconfirmed.closed
            self._end_window(EndedWindow(closed, closed.end_ns, [*unconfirmed.window[:EVAL_NS], 0, 0, 0, 0, 0],
                                         None))
        # Its phase events go back to the pool; its start event stays out, since the step
        # before it may still be waiting on that event as the end of its window.
        if self.timeline is not None:
            for _, begin, end in self._phase_events:
                self.timeline.release(begin)
                self.timeline.release(end)
        return False

    def _end_window(self, ending: EndedWindow) -> None:
        """Send a closed step whose window has ended: as it is on the CPU; on CUDA, to the
        timeline, which sends it once its events are done."""
        if self.timeline is None:
            self.publish_ended(ending)  # after the steps the compiled path queued, in order
            return
        from traceml.probe.clock import PendingDeviceStep

        closed = ending.closed
        self.timeline.submit(PendingDeviceStep(ending, closed.start_event, closed.end_event,
                                               ending.next_start_event, closed.phase_events))

    def unix_s(self, perf_ns: int) -> float:
        """A perf_counter_ns reading as wall-clock seconds since the epoch."""
        return self._unix_at_zero_s + perf_ns / 1e9

    def finish(self) -> None:
        """At the end of the run: the last closed step's window ends where the step ended."""
        if self.auto_steps and self.in_step:
            # Work after the last update (or a run that never updated): not a step.
            self.exit(failed=_NOT_A_STEP)
        if self.syncs is not None:
            self.sync_due_step = self.syncs.finish(self.step_index)
            self._reschedule()
        if self.layers is not None:
            self.layers.finish()
        self.flush_spans()
        if fast_path is not None and fast_path.faults():
            log.warning("traceml: %d phase timings were lost to internal errors", fast_path.faults())
        closed, self._closed = self._closed, None
        if closed is not None:
            # Evaluation (always between steps) and saves since the last step ran after its
            # window: the goodbye carries them (a final evaluation is not that step's).
            window = self.window
            self.tail_eval_ns += window[EVAL_NS]
            self.tail_checkpoint_ns += window[CHECKPOINT_BETWEEN_NS]
            window[CHECKPOINT_NS] -= window[CHECKPOINT_BETWEEN_NS]
            window[EVAL_NS] = window[CHECKPOINT_BETWEEN_NS] = window[INPUT_WAIT_GAP_NS] = 0
            self._end_window(EndedWindow(closed, closed.end_ns, tuple(window), None))

    def evaluation_begin(self) -> bool:
        """A trainer's evaluation starts (Trainer.evaluate, Lightning's validation); False when
        one is already running (nested calls are timed once)."""
        if self.in_evaluation:
            return False
        self.in_evaluation = True
        self._evaluation_start_ns = _now_ns()
        return True

    def evaluation_end(self) -> None:
        if self.in_evaluation:
            self.in_evaluation = False
            self.window[EVAL_NS] += _now_ns() - self._evaluation_start_ns
            if not self.in_step:
                self.count_planned(1)

    def count_planned(self, kind: int) -> None:
        """An evaluation (kind 1) or a save (kind 2) began between steps, in the window now."""
        if self._planned_counted[0] is not self.window:
            self._planned_counted = [self.window, 0, 0]
        self._planned_counted[kind] += 1

    def goodbye(self, exit_code: Optional[int], timeout_s: float = 5.0) -> None:
        """Send what is left and the rank's goodbye, with the evaluation and saves that ran
        after the last step (moved aside by finish, or counted since), and how many."""
        window, counted = self.window, self._planned_counted
        self.sender.close(exit_code=exit_code, timeout_s=timeout_s,
                          tail_eval_ms=(self.tail_eval_ns + window[EVAL_NS]) / 1e6,
                          tail_checkpoint_ms=(self.tail_checkpoint_ns + window[CHECKPOINT_BETWEEN_NS]) / 1e6,
                          tail_counts=counted[1:] if counted[0] is window and self.step_index else [0, 0])

    # -- phases, called by the patches in probe/patches/ ----------------------------------------
    def phase_begin(self, phase: int) -> int:
        """Open a phase. Returns its start (ns) when this call is the outermost one and is
        timed, else 0 (inside another phase or outside the steps); only a caller given a start
        ends the phase, with phase_end(phase, start), so nested calls need no counting."""
        if not self.in_step:
            if not self.auto_steps or (phase == FORWARD and not self._grad_enabled()):
                return 0  # a forward without gradients (evaluation) starts no step
            self.enter()  # steps inferred from the optimizer: the first phase opens one
        if self.open_phase != NO_PHASE:
            return 0
        self.open_phase = phase
        if self.timeline is not None:
            self._open_event = self.timeline.record()
        return _now_ns()

    def phase_end(self, phase: int, start_ns: int) -> None:
        if self.open_phase != phase:  # the step ended meanwhile
            return
        now = _now_ns()
        self.sums[phase] += now - start_ns
        self.open_phase = NO_PHASE
        if self.timeline is not None or self._gradients_done_ns or self.layers_active:
            self._phase_end_extras(phase, now)  # off the plain CPU path, which ends here

    def _phase_end_extras(self, phase: int, now: int) -> None:
        """Device events, deep-dive and DDP collective wait, for the phase that just ended."""
        end_event = self.timeline.record() if self.timeline is not None else None
        if end_event is not None:
            self._phase_events.append((TIMED_PHASES[phase], self._open_event, end_event))
        if phase == BACKWARD and self.layers_active and self.layers.active:
            self.layers.backward_done()
        if self._gradients_done_ns and phase == BACKWARD:
            # From this rank's last gradient to backward's end: waiting for the others.
            self.sums[COMM_WAIT_NS] += now - self._gradients_done_ns
            self._gradients_done_ns = 0
            if end_event is not None:
                self._phase_events.append(("comm_wait", self._gradients_done_event, end_event))
                self._gradients_done_event = None

    def optimizer_stepped(self, optimizer: Any) -> None:
        """Inferred steps: the update that ends a step. With several optimizers stepping in
        turn (a GAN's discriminator, then its generator), a step is one turn of them all: the
        first one seen stepping ends the first step, and once it comes round again the one that
        stepped just before it, the last of the turn, ends the steps. The forward of each
        optimizer's model is forward. The turn is learnt by OptimizerTurn (probe/turns.py)."""
        optimizer_id = id(optimizer)
        # Once the turn is known and no model is awaited, the bookkeeping has nothing to do.
        if optimizer_id != self._settled_optimizer and not self._learn_turn(optimizer, optimizer_id):
            return
        if self.in_step and self.open_phase == NO_PHASE:
            self.__exit__(None, None, None)

    def _learn_turn(self, optimizer: Any, optimizer_id: int) -> bool:
        """optimizer_stepped's bookkeeping until the turn is known: the model each optimizer
        trains, then the turn's word on this update. False when it does not end a step."""
        if optimizer_id not in self._optimizers_seen:
            self._optimizers_seen.add(optimizer_id)
            self.watch_optimizer(optimizer)
            if self.time_the_model_of(optimizer):
                self._model_wait_ends = self.step_index + 2
        elif self._model_wait_ends is not None and self.step_index > self._model_wait_ends:
            # Parameters no module called holds (a free-standing nn.Parameter): stop waiting,
            # since the wait costs every module call a little.
            self.stop_awaiting_models()
            self._model_wait_ends = None
        turn = self._turn
        ends_step = turn.update_ends_step(optimizer_id, self.step_index)
        self._optimizer_ends_steps = turn.step_optimizer is not None
        self._settled_optimizer = turn.settled if self._model_wait_ends is None else None
        return ends_step

    def watch_optimizer(self, optimizer: Any) -> None:
        """An optimizer seen stepping (first seen while inferring steps, or on a sampled step):
        the memory ledger reads its state from now on."""
        ledger = getattr(self.sender, "ledger", None)
        if ledger is not None:
            ledger.watch_optimizer(optimizer)

    def backward_returned(self) -> None:
        """Inferred steps in a loop that no torch.optim optimizer updates (manual SGD, a custom
        update): each top-level backward ends a step. Decided at the first backward: when no
        optimizer has been made by then, backward ends steps until an optimizer steps."""
        if self._optimizer_ends_steps or self.open_phase != NO_PHASE or not self.in_step:
            return
        if self._turn.backward_ends_step():
            self.__exit__(None, None, None)

    def stop_inferring_steps(self) -> None:
        """An explicit trace_step appeared: it decides the steps from now on. A step inferred
        so far, not yet ended by an optimizer step (a forward before the loop), is dropped."""
        self.auto_steps = False
        self.set_steps_from(STEPS_FROM_TRACE_STEP)
        self.stop_awaiting_models()
        if self.in_step:
            self.exit(failed=_NOT_A_STEP)

    @property
    def layers(self) -> Any:
        """The LayerProbe under deep-dive, or None."""
        return self._layers

    @layers.setter
    def layers(self, layers: Any) -> None:
        # Deep-dive from the next step on; the LayerProbe then says which steps need it.
        self._layers = layers
        self.layers_due_step = 0 if layers is not None else math.inf

    def set_steps_from(self, how: str) -> None:
        """How steps are found, for the card: the sender's goodbye carries it."""
        self.sender.steps_from = how

    # -- user spans: Trace.span ---------------------------------------------------------------
    def span_done(self, name: str, start_ns: int, end_ns: int) -> None:
        """One call of a user span, added to its name's total for its step: the step in flight,
        else the step whose window (it runs to the next step's start) this gap belongs to. A
        call in a later step hands the earlier total to the sender as (name, total), for its
        thread to make the SpanRecord of (span_record). Where the
        compiled timers are built, the Trace API's spans do this in C (_fastpath.SpanTotal)."""
        step = self.step_index if self.in_step else max(0, self.step_index - 1)
        held = self.span_totals.get(name)
        if held is not None and held.step == step:
            held.total_ns += end_ns - start_ns
            held.calls += 1
            return
        if held is not None:
            self.sender.push_span((name, held))
        self.span_totals[name] = SpanTotal(step, start_ns, end_ns - start_ns)

    def flush_spans(self) -> None:
        """Hand the sender every span total still held (at the end of the traced run)."""
        totals, self.span_totals = self.span_totals, {}
        for name, total in totals.items():
            self.sender.push_span((name, total))

    def note_failure(self, phase: int) -> None:
        """An exception is leaving this phase: remember where, in case it ends the step."""
        if self.sums[FAILED_PHASE] == NO_PHASE:
            self.sums[FAILED_PHASE] = phase

    def note_gradients_done(self) -> None:
        """DDP: backward has computed this rank's gradients (patches/collectives.py); from
        now to backward's end the rank waits for the others' all-reduce."""
        if self.open_phase != BACKWARD:
            return
        self._gradients_done_ns = _now_ns()
        if self.timeline is not None:
            if self._gradients_done_event is not None:  # an earlier backward's, never ended
                self.timeline.release(self._gradients_done_event)
            self._gradients_done_event = self.timeline.record()

    def comm_waited(self, phase: int, wait_ns: int) -> None:
        """FSDP: a collective inside this phase blocked for wait_ns (probe/sharded.py)."""
        if self.open_phase != phase:  # the step ended meanwhile
            return
        sums = self.sums
        sums[COMM_WAIT_NS] += wait_ns
        if phase == FORWARD:
            sums[FORWARD_COMM_WAIT_NS] += wait_ns
        elif phase == OPTIMIZER:
            sums[OPTIMIZER_COMM_WAIT_NS] += wait_ns

    def cancel_phase(self, phase: int) -> None:
        """Close a phase that turned out not to be one (a `.to()` that moved nothing)."""
        if self.open_phase != phase:
            return
        self.open_phase = NO_PHASE
        if self.timeline is not None:
            self.timeline.release(self._open_event)

    def gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start_ns = _now_ns()
        elif self._gc_start_ns:
            pause_ns = _now_ns() - self._gc_start_ns
            self._gc_start_ns = 0
            window = self.window
            window[GC_NS] += pause_ns
            window[GC_COLLECTIONS] += 1
            if pause_ns > window[GC_MAX_NS]:
                window[GC_MAX_NS] = pause_ns
            generation = info.get("generation", 0)
            window[GC_GEN0_NS + generation] += pause_ns  # generations 0, 1 and 2 follow each other
            if generation == 2:
                window[GC_FULL] += 1


# The process's one probe, made by process.py at the first trace_step or inferred step; the
# patches, the integrations and traceml.summary() find it here.
_probe: Optional[StepProbe] = None


def _log_fault(where: str) -> None:
    """A probe made on its own (no process.py around it) only says what went wrong."""
    log.warning("traceml: internal error in %s", where, exc_info=True)


def _times_no_model(optimizer: Any) -> bool:
    """A probe made on its own hooks no model: none is awaited."""
    return False


def _awaits_no_model() -> None:
    """A probe made on its own awaits no model: nothing to stop."""


def _grad_always_enabled() -> bool:
    """A probe made on its own, before torch is here: every forward may start a step."""
    return True


def _any_optimizer_made() -> bool:
    """Whether this process has made a torch.optim optimizer: making one marks its class's
    step() as hooked (torch's own profiling wrapper), so no instance needs to be found."""
    from torch.optim import Optimizer

    classes = [Optimizer]
    while classes:
        cls = classes.pop()
        if getattr(cls.step, "hooked", False):
            return True
        classes.extend(cls.__subclasses__())
    return False
