"""CUDA event resolution, tested on the CPU with a fake event type: no event is ever waited on."""
import pytest

from traceml.probe.clock import MAX_PENDING_STEPS, DeviceTimeline, PendingDeviceStep, fit_device_phases
from test_records import step


class FakeEvent:
    """Records a device time; completes only when the fake device has run past it."""

    device_now_ms = 0.0
    device_done_ms = 0.0
    created = 0

    def __init__(self):
        FakeEvent.created += 1
        self.at_ms = None
        self.queries = 0

    def record(self):
        self.at_ms = FakeEvent.device_now_ms

    def query(self):
        self.queries += 1
        return self.at_ms is not None and self.at_ms <= FakeEvent.device_done_ms

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time on an event that has not completed"
        return end.at_ms - self.at_ms

    def synchronize(self):  # pragma: no cover - the resolver must never call this
        raise AssertionError("synchronize called")


@pytest.fixture(autouse=True)
def fresh_device():
    FakeEvent.device_now_ms = FakeEvent.device_done_ms = 0.0
    FakeEvent.created = 0


def as_it_is(host):
    """The host side of a pending step, here already its StepRecord (the probe's record_from makes it)."""
    return host


def at(ms, timeline):
    FakeEvent.device_now_ms = ms
    return timeline.record()


def test_steps_resolve_in_order_only_once_their_events_completed():
    timeline = DeviceTimeline(FakeEvent)
    # Step 0 on the device: start 0, forward 0-30, backward 30-90, end 100; next step starts 120.
    start, f0, f1, b0, b1, end = (at(t, timeline) for t in (0, 0, 30, 30, 90, 100))
    next_start = at(120, timeline)
    host = step(0)
    host.step_ms = 120.0  # the host's window: start of step 0 to start of step 1
    timeline.submit(PendingDeviceStep(host, start, end, next_start,
                                      [("forward", f0, f1), ("backward", b0, b1)]))
    FakeEvent.device_done_ms = 95  # the device has not reached the step's end yet
    assert timeline.resolve_ready(as_it_is) == []
    assert timeline.pending_count == 1
    FakeEvent.device_done_ms = 130
    (record,) = timeline.resolve_ready(as_it_is)
    assert record.device_timed
    assert record.forward_ms == 30 and record.backward_ms == 60
    assert record.gpu_idle_ms == 20  # end of step 0 at 100, first event of step 1 at 120
    assert timeline.pending_count == 0


def test_events_go_back_to_the_pool_except_the_next_steps_start():
    timeline = DeviceTimeline(FakeEvent)
    events = [at(t, timeline) for t in (0, 0, 10, 20)]
    next_start = at(30, timeline)
    timeline.submit(PendingDeviceStep(step(0), events[0], events[3], next_start,
                                      [("forward", events[1], events[2])]))
    FakeEvent.device_done_ms = 1000
    timeline.resolve_ready(as_it_is)
    created = FakeEvent.created
    reused = [timeline.record() for _ in range(4)]
    assert FakeEvent.created == created  # four events came back from the pool
    assert next_start not in reused  # still owned by the step it starts


def test_a_later_step_waits_for_an_earlier_one():
    timeline = DeviceTimeline(FakeEvent)
    s0, e0 = at(0, timeline), at(50, timeline)
    s1 = at(50, timeline)
    e1 = at(60, timeline)
    timeline.submit(PendingDeviceStep(step(0), s0, e0, s1, []))
    timeline.submit(PendingDeviceStep(step(1), s1, e1, None, []))
    FakeEvent.device_done_ms = 40
    assert timeline.resolve_ready(as_it_is) == []
    FakeEvent.device_done_ms = 60
    assert [r.step for r in timeline.resolve_ready(as_it_is)] == [0, 1]


def test_pending_steps_are_bounded_when_the_device_never_finishes():
    timeline = DeviceTimeline(FakeEvent)
    FakeEvent.device_now_ms = 10
    for index in range(MAX_PENDING_STEPS + 5):
        timeline.submit(PendingDeviceStep(step(index), timeline.record(), timeline.record(), None, []))
    assert timeline.pending_count == MAX_PENDING_STEPS
    assert timeline.dropped_steps == 5
    assert timeline.resolve_ready(as_it_is) == []  # nothing completed: nothing waited for either


def test_host_waits_hidden_behind_device_work_are_not_counted():
    # Host: 50 ms in the DataLoader while the device still ran 29 ms of this step's work.
    host = step(0)
    host.step_ms, host.input_wait_ms, host.outside_ms = 57.0, 50.0, 1.0
    record = fit_device_phases(host, {"h2d": 0.0, "forward": 10.0, "backward": 20.0,
                                      "optimizer": 5.0}, gpu_idle_ms=21.0)
    assert record.input_wait_ms == pytest.approx(21.0)  # 50 - (50 + 1 + 35 - 57)
    assert record.untraced_ms == 0.0
    parts = (record.input_wait_ms + record.outside_ms + record.h2d_ms + record.forward_ms
             + record.backward_ms + record.optimizer_ms + record.untraced_ms)
    assert parts == pytest.approx(record.step_ms)


def test_a_sync_in_outside_code_is_compute_once_device_timed():
    # Host launches in 6 ms, then blocks 94 ms on loss.item() outside the step.
    host = step(0)
    host.step_ms, host.input_wait_ms, host.outside_ms = 100.0, 0.0, 94.0
    record = fit_device_phases(host, {"h2d": 0.0, "forward": 30.0, "backward": 60.0,
                                      "optimizer": 10.0}, gpu_idle_ms=0.0)
    assert (record.forward_ms, record.backward_ms, record.optimizer_ms) == (30.0, 60.0, 10.0)
    assert record.outside_ms == 0.0 and record.untraced_ms == 0.0


def test_device_phases_longer_than_the_step_are_scaled_to_fit():
    host = step(0)
    host.step_ms, host.input_wait_ms, host.outside_ms = 50.0, 0.0, 0.0
    record = fit_device_phases(host, {"h2d": 0.0, "forward": 40.0, "backward": 60.0,
                                      "optimizer": 0.0}, gpu_idle_ms=None)
    assert record.forward_ms + record.backward_ms == pytest.approx(50.0)
    assert record.backward_ms / record.forward_ms == pytest.approx(1.5)
