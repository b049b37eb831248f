"""The sender's side of the step probe: the StepRecords and SpanRecords of what the training
thread queued, made on the sender's thread. record_from is the one place a step's arithmetic is
written: the compiled timers and the Python ones queue the same EndedWindows."""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Tuple

from traceml.probe.step_state import (
    BACKWARD, CHECKPOINT_BETWEEN_NS, CHECKPOINT_NS, COMM_WAIT_NS, COMPILE_NS, EVAL_NS, FORWARD, FORWARD_CALLS,
    FORWARD_COMM_WAIT_NS, GC_COLLECTIONS, GC_FULL, GC_GEN0_NS, GC_MAX_NS, GC_NS, H2D, INPUT_WAIT_GAP_NS,
    INPUT_WAIT_NS, OPTIMIZER, OPTIMIZER_COMM_WAIT_NS, REAL_TOKENS, SAMPLES, TOKEN_COPIES, TOKENS, EndedWindow)
from traceml.records import SpanRecord, StepRecord


class QueuedSteps(Protocol):
    """What the sender's thread reads of the step probe (a probe.step.StepProbe)."""

    rank: int
    comm_timed: bool  # the collective wait is timed: comm_wait_ms is a figure, else None
    layers: Any  # the LayerProbe under deep-dive (its watch sees each record), or None

    def take_ended(self) -> Tuple[List[EndedWindow], int]:
        """The steps whose window ended since the last call, in order; and how many were dropped."""

    def unix_s(self, perf_ns: int) -> float:
        """A perf_counter_ns reading as wall-clock seconds since the epoch."""


class StepRecords:
    """Makes the records of one probe's steps and spans, on the sender's thread."""

    def __init__(self, probe: QueuedSteps):
        self.probe = probe

    def drain_steps(self) -> Tuple[List[StepRecord], int]:
        """The StepRecords of the steps ended since the last round, in order, and how many a full
        ring dropped. Both paths queue a step's EndedWindow (the compiled one as numbers, made
        into the object as it is taken)."""
        ended, dropped = self.probe.take_ended()
        return [self.record_from(ending) for ending in ended], dropped

    def record_from(self, ending: EndedWindow) -> StepRecord:
        """The StepRecord of a closed step whose window has ended (sender's thread)."""
        probe = self.probe
        closed, window_end_ns = ending.closed, ending.window_end_ns
        window = ending.window
        step, start_ns, end_ns, sums = closed.step, closed.start_ns, closed.end_ns, closed.sums
        h2d_ns, forward_ns, backward_ns, optimizer_ns = sums[H2D], sums[FORWARD], sums[BACKWARD], sums[OPTIMIZER]
        input_wait_inside_ns = sums[INPUT_WAIT_NS]
        gap_ns = window_end_ns - end_ns
        untraced_ns = max(0, end_ns - start_ns - h2d_ns - forward_ns - backward_ns - optimizer_ns
                          - input_wait_inside_ns)
        input_wait_gap_ns = min(window[INPUT_WAIT_GAP_NS], gap_ns)
        # Planned work is beside the step: between steps off outside, saves inside off untraced.
        planned_gap_ns = min(window[EVAL_NS] + window[CHECKPOINT_BETWEEN_NS], gap_ns - input_wait_gap_ns)
        planned_inside_ns = min(window[CHECKPOINT_NS] - window[CHECKPOINT_BETWEEN_NS], untraced_ns)
        # Positional, in StepRecord's field order: the sender makes one a step, and keywords
        # would cost it a 31-entry dict each time (about a third of its work per step).
        record = StepRecord(
            probe.rank, step, probe.unix_s(start_ns),  # rank, step, start_unix_s
            (window_end_ns - start_ns - planned_gap_ns - planned_inside_ns) / 1e6,  # step_ms
            (input_wait_inside_ns + input_wait_gap_ns) / 1e6,  # input_wait_ms
            (gap_ns - input_wait_gap_ns - planned_gap_ns) / 1e6,  # outside_ms
            h2d_ns / 1e6, forward_ns / 1e6, backward_ns / 1e6, optimizer_ns / 1e6,  # h2d .. optimizer_ms
            (untraced_ns - planned_inside_ns) / 1e6,  # untraced_ms
            window[GC_NS] / 1e6, window[GC_COLLECTIONS], sums[FORWARD_CALLS], sums[SAMPLES],  # gc_ms .. samples
            False, None,  # device_timed, gpu_idle_ms: the DeviceTimeline's, on CUDA
            closed.device_allocated_bytes, closed.device_peak_bytes, closed.device_reserved_bytes,
            closed.host_rss_bytes,
            sums[COMM_WAIT_NS] / 1e6 if probe.comm_timed else None,  # comm_wait_ms
            window[GC_MAX_NS] / 1e6, window[GC_FULL],  # gc_max_pause_ms, gc_full_collections
            window[GC_GEN0_NS] / 1e6, window[GC_GEN0_NS + 1] / 1e6, window[GC_GEN0_NS + 2] / 1e6,  # by generation
            sums[TOKENS], real_tokens(sums[REAL_TOKENS], sums[TOKEN_COPIES]),
            window[EVAL_NS] / 1e6, window[CHECKPOINT_NS] / 1e6, closed.instrumented, window[COMPILE_NS] / 1e6,
            sums[FORWARD_COMM_WAIT_NS] / 1e6, sums[OPTIMIZER_COMM_WAIT_NS] / 1e6)
        layers = probe.layers
        if layers is not None and layers.watch is not None:
            layers.watch.observe(record)
        return record

    def span_record(self, ended: tuple) -> SpanRecord:
        """The SpanRecord of a (name, total) that span_done handed over."""
        name, total = ended
        return SpanRecord(self.probe.rank, total.step, name, self.probe.unix_s(total.start_ns), total.total_ns / 1e6,
                          total.calls)


def real_tokens(counted: Optional[int], copies: Optional[List[Any]]) -> Optional[int]:
    """Real tokens of a step: counted on the host, plus device masks' sums copied to the host.
    Read once the step is resolved: on CUDA its end event is done, so the copies made before
    it are too, and reading them waits for nothing."""
    if not copies:
        return counted
    return (counted or 0) + sum(int(copy) for copy in copies)
