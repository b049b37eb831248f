"""The step's state shared with the compiled timers: the slots of its lists, the objects a step's
end queues (ClosedStep, EndedWindow), the compiled module when it loads, and the Python state
class that stands in for it when it does not.

The compiled state (_fastpath.ProbeState) holds the same fields in a C struct its timers read
directly; both are laid out by layout.py. StepProbe (step.py) is built on whichever loads.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import time
from typing import Any, Optional, Tuple

import msgspec

from traceml.probe import layout
from traceml.records import TIMED_PHASES

log = logging.getLogger("traceml")
_now_ns = time.perf_counter_ns

# The lists a step's patches add to, laid out in layout.py (see there for each slot): the
# window's (a new list for each window: the old one goes out with the step) and the step's.
WINDOW_ZEROS = (0,) * len(layout.WINDOW_SLOTS)
window_slot = {name: index for index, name in enumerate(layout.WINDOW_SLOTS)}.__getitem__
EVAL_NS, CHECKPOINT_NS, COMPILE_NS, CHECKPOINT_BETWEEN_NS, INPUT_WAIT_GAP_NS = map(window_slot, (
    "eval_ns", "checkpoint_ns", "compile_ns", "checkpoint_between_ns", "input_wait_gap_ns"))
GC_NS, GC_COLLECTIONS, GC_MAX_NS, GC_FULL, GC_GEN0_NS = map(window_slot, (
    "gc_ns", "gc_collections", "gc_max_ns", "gc_full", "gc_gen0_ns"))
STEP_ZEROS = tuple(zero for _, zero in layout.STEP_SLOTS)
step_slot = {name: index for index, (name, _) in enumerate(layout.STEP_SLOTS)}.__getitem__
(H2D, FORWARD, BACKWARD, OPTIMIZER, INPUT_WAIT_NS, FORWARD_CALLS, SAMPLES, TOKENS, COMM_WAIT_NS,
 FORWARD_COMM_WAIT_NS, OPTIMIZER_COMM_WAIT_NS, REAL_TOKENS, TOKEN_COPIES, FAILED_PHASE) = map(step_slot, (
    "h2d", "forward", "backward", "optimizer", "input_wait_ns", "forward_calls", "samples", "tokens",
    "comm_wait_ns", "forward_comm_wait_ns", "optimizer_comm_wait_ns", "real_tokens", "token_copies",
    "failed_phase"))
NO_PHASE = layout.NO_PHASE
assert [step_slot(name) for name in TIMED_PHASES] == [H2D, FORWARD, BACKWARD, OPTIMIZER]  # indexes them


class SpanTotal:
    """A user span's calls in one step, summed where they end (StepProbe.span_done)."""

    __slots__ = ("step", "start_ns", "total_ns", "calls")

    def __init__(self, step: int, start_ns: int, total_ns: int):
        self.step, self.start_ns, self.total_ns, self.calls = step, start_ns, total_ns, 1


class ClosedStep(msgspec.Struct, gc=False):
    """A step as it ended on the training thread: clock readings and the list its phases were
    summed in. Not a StepRecord yet: that arithmetic happens on the sender's thread once the
    step's window has ended (step_records.StepRecords.record_from). gc=False: it holds no cycle."""

    step: int
    start_ns: int
    end_ns: int
    sums: list  # see STEP_ZEROS
    device_allocated_bytes: Optional[int]
    device_peak_bytes: Optional[int]
    device_reserved_bytes: Optional[int]
    start_event: Any  # on CUDA the step's events (else None), resolved by the DeviceTimeline
    end_event: Any
    phase_events: Any  # on CUDA [(phase, begin event, end event)]
    host_rss_bytes: Optional[int]
    instrumented: bool  # a deep-dive sample ran: not the user's speed


class EndedWindow(msgspec.Struct, gc=False):
    """A closed step whose window has ended at the next step's start (or at its own end, the
    last): what the sender turns into the step's StepRecord."""

    closed: ClosedStep
    window_end_ns: int
    window: Any  # see WINDOW_ZEROS
    next_start_event: Any  # on CUDA the next step's start event, the window's end (else None)


def _free_threaded() -> bool:
    """A free-threaded Python (3.13t and later): its build says so, or the GIL is off now."""
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    if gil_enabled is None:  # before 3.13: no free-threaded build exists
        return False
    import sysconfig

    return not gil_enabled() or bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


ENV_NO_FASTPATH = "TRACEML_NO_FASTPATH"  # set to anything but "" or "0": the Python timers only


def python_timers_asked(environ: Any = os.environ) -> bool:
    """Whether the environment turns the compiled timers off (TRACEML_NO_FASTPATH=1; =0 does not)."""
    return environ.get(ENV_NO_FASTPATH, "") not in ("", "0")


def _load_fast_path() -> Any:
    """The compiled timers (probe/_fastpath.c) when they are built, their clock is this module's
    and TRACEML_NO_FASTPATH does not turn them off (python_timers_asked); else None, and the
    Python patches time every call.

    Not on a free-threaded Python: the compiled state relies on the GIL between the training
    thread and the sender's, and importing it there would turn the GIL back on for the user's
    whole program (with a warning), so it is not imported at all."""
    if python_timers_asked():
        return None
    if _free_threaded():
        log.debug("traceml: a free-threaded Python; using the Python timers")
        return None
    try:
        from traceml.probe import _fastpath
    except ImportError:
        return None
    # The C makes ClosedStep and EndedWindow by position from layout.py's fields: those must be theirs.
    built_from = (tuple(name for name, _ in layout.STEP_SLOTS), layout.WINDOW_SLOTS, ClosedStep.__struct_fields__,
                  EndedWindow.__struct_fields__, tuple(name for name, _ in layout.STATE_FIELDS))
    if getattr(_fastpath, "VERSION", None) != layout.VERSION or getattr(_fastpath, "LAYOUT", ()) != built_from:
        log.debug("traceml: the compiled timers were built from another layout; using Python's")
        return None
    before_ns, fast_ns, after_ns = _now_ns(), _fastpath.now_ns(), _now_ns()
    if not before_ns <= fast_ns <= after_ns:  # another clock than perf_counter_ns: not comparable
        log.debug("traceml: the compiled timers' clock is not perf_counter_ns; using Python's")
        return None
    _fastpath.configure(ClosedStep, EndedWindow, STEP_ZEROS, WINDOW_ZEROS)
    return _fastpath


fast_path = _load_fast_path()


class PythonProbeState:
    """The fields a step's patches read and write on every call, where the compiled timers are
    not built; else _fastpath.ProbeState, the same fields in a C struct its timers read
    directly, whose __enter__ and __exit__ do the common step's start and end in C and hand
    every other to enter and exit."""

    # layout.py's fields (the C struct's), and what the compiled state keeps in C alone.
    __slots__ = tuple(name for name, _ in layout.STATE_FIELDS) + ("_closed", "_unconfirmed", "_ended_steps",
                                                                   "_steps_dropped")

    # -- step boundaries: `with trace_step(model):` enters and exits the probe itself ---------
    def __enter__(self) -> "PythonProbeState":
        return self.enter()  # type: ignore[attr-defined]

    def __exit__(self, exc_type: Any, failed: Optional[BaseException], tb: Any) -> None:
        self.exit(failed=failed)  # type: ignore[attr-defined]

    def __init__(self) -> None:
        # The steps whose window has ended, as EndedWindows, until the sender's thread takes
        # them (take_ended), and how many were dropped meanwhile: the compiled state's ring.
        self._ended_steps: Any = collections.deque()
        self._steps_dropped = 0

    # -- ended steps: the compiled state queues them in a ring of numbers, here in a deque of
    # EndedWindows; either way the sender's thread takes them (take_ended) and makes their
    # StepRecords, so that the training thread does none of that arithmetic.
    def publish_ended(self, ending: "EndedWindow") -> None:
        sender = self.sender
        try:
            held = len(self._ended_steps) + len(sender._buffer)
        except AttributeError:  # a sender without a buffer of its own: its push decides, as in C
            sender.push(ending)
            return
        # The steps waiting and the sender's buffer together hold its capacity, as in C.
        if held >= sender.capacity:
            self._steps_dropped += 1
        else:
            self._ended_steps.append(ending)

    def take_ended(self) -> Tuple[list, int]:
        ended, steps = self._ended_steps, []
        while ended:  # one at a time: the training thread may append meanwhile
            steps.append(ended.popleft())
        dropped = self._steps_dropped
        self._steps_dropped -= dropped  # not = 0: a drop counted meanwhile stays for next time
        return steps, dropped
