"""The probe in this process, on a real tiny model: phases, windows, patches, and their removal."""
import copy
import gc
import inspect
import pickle
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, dataloader

from traceml.probe import phases
from traceml.probe.step import StepProbe


class ListSender:
    def __init__(self):
        self.raw = []

    def push(self, item):
        self.raw.append(item)


class SlowForward(nn.Module):
    """A linear layer whose forward also sleeps, so forward time is known from outside."""

    def __init__(self, sleep_ms=0.0):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.sleep_s = sleep_ms / 1000.0

    def forward(self, inputs):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.linear(inputs)


@pytest.fixture
def probe():
    originals = (torch.autograd.backward, dataloader._BaseDataLoaderIter.__next__, torch.Tensor.to)
    sender = ListSender()
    probe = StepProbe(sender)
    phases.install_patches(probe)
    yield probe
    phases.remove_patches()
    assert (torch.autograd.backward, dataloader._BaseDataLoaderIter.__next__, torch.Tensor.to) == originals


def records(probe):
    probe.finish()
    return [probe.record_from(raw) for raw in probe.sender.raw]


def test_phases_land_where_the_time_went(probe):
    model = SlowForward(sleep_ms=20)
    handles = phases.hook_model(probe, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = iter(DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    for _ in range(3):
        (batch,) = next(loader)
        time.sleep(0.005)  # outside the step, not in the DataLoader
        with probe:
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()
            time.sleep(0.010)  # inside the step, in no phase
    for handle in handles:
        handle.remove()
    steps = records(probe)
    assert [r.step for r in steps] == [0, 1, 2]
    for record in steps:
        assert 20.0 <= record.forward_ms < 40.0
        assert record.backward_ms > 0 and record.optimizer_ms > 0
        assert record.untraced_ms >= 10.0
        assert record.forward_calls == 1 and record.samples == 4
        parts = (record.input_wait_ms + record.outside_ms + record.h2d_ms + record.forward_ms
                 + record.backward_ms + record.optimizer_ms + record.untraced_ms)
        assert parts == pytest.approx(record.step_ms, rel=1e-9)
    for record in steps[:-1]:  # the gap after each step belongs to it; the last has none
        assert record.outside_ms >= 5.0
        assert record.input_wait_ms > 0.0
    assert steps[-1].outside_ms == 0.0 and steps[-1].input_wait_ms == 0.0


def test_only_the_outermost_forward_is_timed_and_calls_are_counted(probe):
    model = SlowForward()
    phases.hook_model(probe, model)
    with probe:
        for _ in range(4):  # four micro-batches in one step
            model(torch.randn(3, 4))
    (record,) = records(probe)
    assert record.forward_calls == 4 and record.samples == 12


def test_forward_outside_a_step_is_not_forward(probe):
    model = SlowForward(sleep_ms=10)
    phases.hook_model(probe, model)
    with probe:
        pass
    model(torch.randn(2, 4))  # an evaluation between steps
    with probe:
        pass
    first, second = records(probe)
    assert first.forward_ms == 0.0 and first.outside_ms >= 10.0


def test_a_nested_trace_step_is_one_step(probe):
    with probe:
        with probe:
            time.sleep(0.002)
    with probe:
        pass
    assert [r.step for r in records(probe)] == [0, 1]


def test_a_failed_step_is_dropped_and_the_next_one_is_clean(probe):
    model = SlowForward()
    phases.hook_model(probe, model)
    with pytest.raises(RuntimeError):
        with probe:
            model(torch.randn(2, 4))
            raise RuntimeError("inside the step")
    with probe:
        model(torch.randn(5, 4))
    (record,) = records(probe)
    assert record.step == 0 and record.forward_calls == 1 and record.samples == 5


def test_copies_to_another_device_are_h2d_and_cpu_casts_are_not(probe):
    host = torch.randn(256, 256)

    class MovesInside(SlowForward):
        def forward(self, inputs):
            inputs.to("meta")  # the model's own business: part of forward
            return super().forward(inputs)

    model = MovesInside()
    phases.hook_model(probe, model)
    with probe:
        host.to(torch.float64)  # stays on the CPU: not a copy to a device
    with probe:
        host.to("meta")  # a real move to another device
    with probe:
        model(torch.randn(2, 4))
    cast, moved, inside_forward = records(probe)
    assert cast.h2d_ms == 0.0
    assert moved.h2d_ms > 0.0
    assert inside_forward.h2d_ms == 0.0 and inside_forward.forward_ms > 0.0


def test_garbage_collector_pauses_are_counted(probe):
    junk = [[i] for i in range(200_000)]
    with probe:
        gc.collect()
    (record,) = records(probe)
    assert record.gc_collections >= 1 and record.gc_ms > 0.0
    assert record.gc_full_collections >= 1 and record.gc_gen2_ms > 0.0  # gc.collect() is full
    assert record.gc_gen0_ms + record.gc_gen1_ms + record.gc_gen2_ms == pytest.approx(record.gc_ms)
    del junk


def test_timed_forward_pickles_and_copies_as_the_models_own(probe):
    model = SlowForward()
    signature = inspect.signature(model.forward)
    phases.hook_model(probe, model)
    assert isinstance(model.__dict__["forward"], phases.TimedForward)
    assert inspect.signature(model.forward) == signature
    assert model.forward.__name__ == "forward"
    restored = pickle.loads(pickle.dumps(model))
    twin = copy.deepcopy(model)
    for other in (restored, twin):
        assert not isinstance(other.__dict__.get("forward"), phases.TimedForward)
        assert torch.equal(other(torch.ones(1, 4)), model(torch.ones(1, 4)))
    state = model.state_dict()
    assert set(state) == {"linear.weight", "linear.bias"}


def test_removing_the_forward_handle_restores_the_model(probe):
    model = SlowForward()
    (handle,) = phases.hook_model(probe, model)
    handle.remove()
    assert "forward" not in model.__dict__
    with probe:
        model(torch.randn(2, 4))
    (record,) = records(probe)
    assert record.forward_calls == 0
