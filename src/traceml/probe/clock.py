"""Device-side phase timing: pooled CUDA events recorded on the hot path, resolved later by query().

The training thread only takes an event from the pool and records it. The sender's background
thread asks each step's events `query()` in order and, once the last one has completed, reads
`elapsed_time` between them. Nothing here ever synchronizes the device. The event type is
injected, so the logic is tested on the CPU with a fake event.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Protocol, Tuple

import msgspec

from traceml.records import TIMED_PHASES, StepRecord


class DeviceEvent(Protocol):
    """What the timeline asks of an event (torch.cuda.Event; a fake one in the tests)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # torch.cuda.Event takes its own type


MAX_PENDING_STEPS = 4096  # a device that stops completing work must not grow memory forever


class PendingDeviceStep(NamedTuple):
    """A finished step whose host figures are known and whose device figures are in flight."""

    host: Any  # the host-timed step: a StepRecord, or the probe's EndedWindow for one
    start_event: DeviceEvent
    end_event: DeviceEvent
    next_start_event: Optional[DeviceEvent]  # the first event of the next step; None when the run ended after this step
    phase_events: List[Tuple[str, DeviceEvent, DeviceEvent]]

    def events(self) -> List[DeviceEvent]:
        """Each event once (the comm-wait pair shares backward's end event)."""
        evs = {id(self.start_event): self.start_event, id(self.end_event): self.end_event}
        if self.next_start_event is not None:
            evs[id(self.next_start_event)] = self.next_start_event
        for _, begin, end in self.phase_events:
            evs[id(begin)] = begin
            evs[id(end)] = end
        return list(evs.values())


class DeviceTimeline:
    """An event pool and the FIFO of steps waiting for their events to complete."""

    def __init__(self, make_event: Callable[[], DeviceEvent]):
        self._make_event = make_event
        self._pool: List[DeviceEvent] = []
        self._pending: Deque[PendingDeviceStep] = collections.deque()
        self.dropped_steps = 0

    # -- training thread ------------------------------------------------------------------
    def record(self) -> DeviceEvent:
        """Record an event on the current stream now; cheap enough for the hot path."""
        try:
            event = self._pool.pop()
        except IndexError:
            event = self._make_event()
        event.record()
        return event

    def release(self, event: DeviceEvent) -> None:
        self._pool.append(event)

    def submit(self, step: PendingDeviceStep) -> None:
        if len(self._pending) >= MAX_PENDING_STEPS:
            self.dropped_steps += 1
            return
        self._pending.append(step)

    # -- background thread ----------------------------------------------------------------
    def resolve_ready(self, record_from: Callable[[Any], StepRecord]) -> List[StepRecord]:
        """Turn every leading pending step whose events have all completed into a record:
        record_from makes its host side (PendingDeviceStep.host; the sender passes its StepRecords')."""
        done: List[StepRecord] = []
        while self._pending:
            step = self._pending[0]
            events = step.events()
            if not all(event.query() for event in events):
                break  # steps complete in stream order: later ones are not ready either
            self._pending.popleft()
            done.append(_resolve(step, record_from(step.host)))
            # The next step's start event belongs to that step and is released with it.
            for event in events:
                if event is not step.next_start_event:
                    self.release(event)
        return done

    @property
    def pending_count(self) -> int:
        return len(self._pending)


def _resolve(step: PendingDeviceStep, host: StepRecord) -> StepRecord:
    device_ms: Dict[str, float] = {phase: 0.0 for phase in TIMED_PHASES + ("comm_wait",)}
    for phase, begin, end in step.phase_events:
        device_ms[phase] += max(0.0, float(begin.elapsed_time(end)))
    gpu_idle_ms = None
    if step.next_start_event is not None:
        gpu_idle_ms = max(0.0, float(step.end_event.elapsed_time(step.next_start_event)))
    comm_wait_ms = device_ms.pop("comm_wait")  # inside backward: not a phase of its own
    record = fit_device_phases(host, device_ms, gpu_idle_ms)
    if host.comm_wait_ms is not None:
        record = msgspec.structs.replace(record, comm_wait_ms=min(comm_wait_ms, record.backward_ms))
    return record


def fit_device_phases(host: StepRecord, device_ms: Dict[str, float],
                      gpu_idle_ms: Optional[float]) -> StepRecord:
    """Replace host-timed device phases by their device durations, keeping the sum = step_ms.

    On an accelerator the host runs ahead: launching a forward takes far less host time than
    the forward takes on the device, and the host later blocks somewhere else (a `.item()` in
    `outside`, the DataLoader) while the device catches up. Host waiting that overlapped
    device work cost nothing, so the excess comes off the host-side waits first (input wait,
    then outside); what is left over is untraced. If the device phases alone exceed the
    step's wall time (a growing device backlog), they are scaled to fit.
    """
    wall = host.step_ms
    input_wait, outside = host.input_wait_ms, host.outside_ms
    phases = dict(device_ms)
    untraced = wall - input_wait - outside - sum(phases.values())
    if untraced < 0:
        hidden = -untraced
        input_wait, hidden = max(0.0, input_wait - hidden), max(0.0, hidden - input_wait)
        outside, hidden = max(0.0, outside - hidden), max(0.0, hidden - outside)
        untraced = 0.0
        if hidden > 0:
            device_total = sum(phases.values())
            scale = (device_total - hidden) / device_total if device_total > 0 else 0.0
            phases = {name: ms * scale for name, ms in phases.items()}
    return msgspec.structs.replace(
        host, input_wait_ms=input_wait, outside_ms=outside, h2d_ms=phases["h2d"], forward_ms=phases["forward"],
        backward_ms=phases["backward"], optimizer_ms=phases["optimizer"], untraced_ms=untraced, device_timed=True,
        gpu_idle_ms=gpu_idle_ms)
