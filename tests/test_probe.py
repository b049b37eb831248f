"""The probe in this process, on a real tiny model: phases, windows, patches, and their removal."""
import copy
import gc
import inspect
import io
import pickle
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, dataloader

from traceml.probe.patches import Patches
from traceml.probe.patches.first_call import FirstModelCall
from traceml.probe.step_state import EndedWindow
from traceml.probe.step import StepProbe
from traceml.probe.step_records import StepRecords
from traceml.records import StepRecord


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


class CompiledInPlace(SlowForward):
    """A class of its own for model.compile(): dynamo caches compiled code per class."""


@pytest.fixture
def patches():
    originals = (torch.autograd.backward, dataloader._BaseDataLoaderIter.__next__, torch.Tensor.to)
    patches = Patches(StepProbe(ListSender()), FirstModelCall())
    patches.install()
    yield patches
    patches.remove()
    assert (torch.autograd.backward, dataloader._BaseDataLoaderIter.__next__, torch.Tensor.to) == originals


@pytest.fixture
def probe(patches):
    return patches.probe


def records(probe):
    probe.finish()
    made = StepRecords(probe)
    ended, _ = made.drain_steps()  # the compiled path's steps, as the sender's round takes them
    return [raw if type(raw) is StepRecord else made.record_from(raw) for raw in [*probe.sender.raw, *ended]
            if type(raw) in (StepRecord, EndedWindow)]


def beside_ms(record, following):
    """What a step's window held beside its step time: from its start to the next step's, less
    its step_ms (the planned work, never the step's)."""
    return (following.start_unix_s - record.start_unix_s) * 1e3 - record.step_ms


def test_phases_land_where_the_time_went(probe, patches):
    model = SlowForward(sleep_ms=20)
    handles = patches.hook_model(model)
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
    # The 20 ms sleep is in forward, and not much more: a busy machine once woke a step's sleep
    # 28 ms late (48.6 ms), so the least of the three is held under 40.
    assert min(record.forward_ms for record in steps) < 40.0, steps
    for record in steps:
        assert record.forward_ms >= 20.0
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


def test_every_figure_of_a_closed_step_lands_in_its_own_field():
    """StepRecords.record_from builds the StepRecord positionally (the sender makes one a step): each input
    is given a distinct value here, so a figure in a neighbour's place fails."""
    from traceml.probe.step_state import ClosedStep

    probe = StepProbe(ListSender())
    probe.comm_timed = True
    ms = 1_000_000
    # h2d, forward, backward, optimizer, input wait inside, forward calls, samples, tokens,
    # comm wait, of it in forward and in the optimizer, real tokens, token copies, failed phase
    sums = [1 * ms, 2 * ms, 3 * ms, 4 * ms, 5 * ms, 6, 7, 8, 9 * ms, 2 * ms, 1 * ms, 10, None, -1]
    # gc ns, collections, longest, full, gen 0, 1, 2, eval, checkpoint, compile, saves between, input wait gap
    window = [11 * ms, 12, 13 * ms, 14, 15 * ms, 16 * ms, 17 * ms, 18 * ms, 19 * ms, 20 * ms, 0, 21 * ms]
    start_ns, end_ns = 100 * ms, 150 * ms
    closed = ClosedStep(22, start_ns, end_ns, sums, 23, 24, 25, None, None, None, 26, True)
    record = StepRecords(probe).record_from(EndedWindow(closed, end_ns + 40 * ms, window, None))
    fields = {name: getattr(record, name) for name in record.__struct_fields__}
    assert fields == dict(
        # planned work beside the step: the evaluation off outside, the save (inside) off untraced
        rank=0, step=22, start_unix_s=probe.unix_s(start_ns), step_ms=90.0 - 18 - 19, input_wait_ms=5.0 + 21.0,
        outside_ms=40.0 - 21.0 - 18, h2d_ms=1.0, forward_ms=2.0, backward_ms=3.0, optimizer_ms=4.0,
        untraced_ms=50.0 - 1 - 2 - 3 - 4 - 5 - 19, gc_ms=11.0, gc_collections=12, forward_calls=6, samples=7,
        device_timed=False, gpu_idle_ms=None, device_allocated_bytes=23, device_peak_bytes=24,
        device_reserved_bytes=25, host_rss_bytes=26, comm_wait_ms=9.0, gc_max_pause_ms=13.0,
        gc_full_collections=14, gc_gen0_ms=15.0, gc_gen1_ms=16.0, gc_gen2_ms=17.0, tokens=8, real_tokens=10,
        eval_ms=18.0, checkpoint_ms=19.0, instrumented=True, compile_ms=20.0, forward_comm_wait_ms=2.0,
        optimizer_comm_wait_ms=1.0, cpu_wait_ms=None, on_cpu_ms=None)  # the sender stamps the thread's CPU


def test_only_the_outermost_forward_is_timed_and_calls_are_counted(probe, patches):
    model = SlowForward()
    patches.hook_model(model)
    with probe:
        for _ in range(4):  # four micro-batches in one step
            model(torch.randn(3, 4))
    (record,) = records(probe)
    assert record.forward_calls == 4 and record.samples == 12


def test_forward_outside_a_step_is_not_forward(probe, patches):
    model = SlowForward(sleep_ms=10)
    patches.hook_model(model)
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


def test_a_failed_step_is_dropped_and_the_next_one_is_clean(probe, patches):
    model = SlowForward()
    patches.hook_model(model)
    with pytest.raises(RuntimeError):
        with probe:
            model(torch.randn(2, 4))
            raise RuntimeError("inside the step")
    with probe:
        model(torch.randn(5, 4))
    (record,) = records(probe)
    assert record.step == 0 and record.forward_calls == 1 and record.samples == 5


def test_copies_to_another_device_are_h2d_and_cpu_casts_are_not(probe, patches):
    host = torch.randn(256, 256)

    class MovesInside(SlowForward):
        def forward(self, inputs):
            inputs.to("meta")  # the model's own business: part of forward
            return super().forward(inputs)

    model = MovesInside()
    patches.hook_model(model)
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


def test_a_traced_model_pickles_copies_and_saves_as_the_untraced_one(probe, tmp_path, patches):
    torch.manual_seed(0)
    model = SlowForward()
    reference = pickle.dumps(model)
    (tmp_path / "before").mkdir()
    (tmp_path / "after").mkdir()
    torch.save(model, tmp_path / "before" / "model.pt")  # the archive is named after the file
    signature = inspect.signature(model.forward)
    keys = set(model.__dict__)
    handles = patches.hook_model(model)
    with probe:
        model(torch.ones(1, 4))
    assert type(model) is SlowForward and set(model.__dict__) == keys
    assert inspect.signature(model.forward) == signature
    assert pickle.dumps(model) == reference and b"traceml" not in reference
    torch.save(model, tmp_path / "after" / "model.pt")
    assert (tmp_path / "after" / "model.pt").read_bytes() == (tmp_path / "before" / "model.pt").read_bytes()
    twin = copy.deepcopy(model)
    assert set(twin.__dict__) == keys and torch.equal(twin(torch.ones(1, 4)), model(torch.ones(1, 4)))
    assert set(model.state_dict()) == {"linear.weight", "linear.bias"}
    for handle in handles:
        handle.remove()


def test_only_the_traced_instance_is_timed_and_removal_restores_its_class(probe, patches):
    model, twin = SlowForward(sleep_ms=5), SlowForward(sleep_ms=5)
    (handle,) = patches.hook_model(model)
    assert "_call_impl" in SlowForward.__dict__ or "__call__" in SlowForward.__dict__
    with probe:
        twin(torch.randn(2, 4))  # same class, another object: an EMA copy, say
    with probe:
        model(torch.randn(3, 4))
    handle.remove()
    assert "_call_impl" not in SlowForward.__dict__ and "__call__" not in SlowForward.__dict__
    with probe:
        model(torch.randn(2, 4))
    untimed, timed, removed = records(probe)
    assert untimed.forward_calls == 0 and untimed.forward_ms == 0.0
    assert timed.forward_calls == 1 and timed.samples == 3 and timed.forward_ms >= 5.0
    assert removed.forward_calls == 0


def test_deep_dive_leaves_no_hook_on_the_users_tensors(probe, patches):
    from traceml.probe.layers import LayerProbe

    class LearnedQuery(nn.Module):  # a parameter handed to a submodule, as attention pooling does
        def __init__(self):
            super().__init__()
            self.query = nn.Parameter(torch.randn(1, 4))
            self.mix = nn.Linear(4, 4)

        def forward(self, inputs):
            return self.mix(self.query) + inputs

    model = LearnedQuery()
    inputs = torch.randn(2, 4, requires_grad=True)  # the user's own leaf tensor
    patches.hook_model(model)
    probe.layers = LayerProbe(probe, model, every_n_steps=1)
    for _ in range(3):  # sampled steps: layer hooks on, tensors of the graph watched
        with probe:
            model(inputs).sum().backward()
    assert probe.layers.sampled_steps >= 2
    assert probe.layers.stats["mix"][2] > 0  # its backward was still timed
    for tensor in (model.query, inputs):
        assert not tensor._backward_hooks  # nothing left on them, nothing to travel with them


def test_compiled_models_keep_their_graphs_and_the_forward_is_timed(probe, patches):
    import torch._dynamo
    from torch._dynamo.utils import counters

    class Doubled(nn.Module):  # calls the traced model from inside a compiled region
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            return self.inner(inputs) * 2

    torch._dynamo.reset()
    counters.clear()
    model = SlowForward()
    patches.hook_model(model)
    compiled, parent = torch.compile(model, backend="eager"), torch.compile(Doubled(model), backend="eager")
    inputs = torch.randn(3, 4)
    for _ in range(2):
        with probe:
            compiled(inputs)
    with probe:
        parent(inputs)
    in_place = CompiledInPlace()
    in_place.compile(backend="eager")  # compiled before TraceML sees it: the instance's own call
    patches.hook_model(in_place)
    with probe:
        in_place(inputs)
    assert counters["stats"]["unique_graphs"] == 3  # one each: TraceML added no graph break
    assert counters["frames"]["total"] == 3  # and dynamo never looked at TraceML's own code
    assert not counters["graph_break"] and not counters["recompiles"]
    first, second, inside_parent, compiled_in_place = records(probe)
    assert first.forward_calls == second.forward_calls == 1 and second.forward_ms > 0.0
    assert inside_parent.forward_calls == 0  # inside a compiled region: dynamo's, untouched
    assert compiled_in_place.forward_calls == 1
    assert torch.equal(parent(inputs), model(inputs) * 2)
    assert b"traceml" not in pickle.dumps(in_place)


def test_a_model_timed_before_it_is_compiled_compiles_once(probe, patches):
    """torch.compile inlines TraceML's call wrapper for a model it timed before: nothing read
    there may become a guard (a flag read did, and recompiled every call up to dynamo's limit)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    patches.hook_model(model)
    inputs = torch.randn(3, 4)
    for _ in range(2):
        with probe:
            model(inputs)
    compiled = torch.compile(model, backend="eager")  # torch.nn's own class: dynamo inlines its call
    patches.hook_model(compiled)  # as trace_step(compiled) does
    for _ in range(4):
        with probe:
            compiled(inputs)
    assert counters["stats"]["unique_graphs"] == 1
    assert [record.forward_calls for record in records(probe)] == [1] * 6


def test_evaluation_and_checkpoint_saves_are_counted_where_they_happen(probe, tmp_path, patches):
    model = SlowForward(sleep_ms=5)
    patches.hook_model(model)
    loader = iter(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    # What the save inside the step writes, 64 MiB: tens of ms, far above what a busy machine's
    # preemptions add to the rest of the step. Made before the steps, whose time it is not.
    state = {"model": model.state_dict(), "buffers": torch.zeros(16 * 2**20)}
    with probe:
        model(torch.randn(2, 4))
    with torch.no_grad():  # evaluation between steps: the model's call and its batch
        next(loader)
        model(torch.randn(2, 4))
    torch.save(model.state_dict(), tmp_path / "between.pt")
    with probe:
        model(torch.randn(2, 4))
        torch.save(state, tmp_path / "inside.pt")
    first, second = records(probe)
    assert first.eval_ms >= 5.0 and first.forward_calls == 1  # evaluation is not the step's forward
    assert first.checkpoint_ms > 0.0
    # Both were between steps: beside the step's time, not in its outside.
    assert beside_ms(first, second) == pytest.approx(first.eval_ms + first.checkpoint_ms, abs=0.01)
    assert first.outside_ms < first.eval_ms
    assert second.eval_ms == 0.0 and second.checkpoint_ms > 0.0
    assert second.untraced_ms < second.checkpoint_ms / 2  # inside the step, beside its time
    assert torch.save.__wrapped__ is not None and torch.save.__name__ == "save"


class SlowBatches(torch.utils.data.Dataset):
    """Batches that take load_ms each to fetch."""

    def __init__(self, load_ms):
        self.load_s = load_ms / 1e3

    def __len__(self):
        return 3

    def __getitem__(self, index):
        time.sleep(self.load_s)
        return torch.randn(4)


def test_an_evaluation_with_a_region_each_batch_runs_from_its_eval_and_each_is_counted(probe, patches):
    # run_clm_no_trainer's evaluation: model.eval(), then each batch fetched with gradients on
    # and its forward alone under no_grad; two after the last step, and two saves.
    model = SlowForward(sleep_ms=2)
    patches.hook_model(model)
    probe.sender.close = lambda **goodbye: probe.sender.raw.append(goodbye)

    def evaluate():
        started = time.perf_counter()
        model.eval()
        for batch in DataLoader(SlowBatches(load_ms=5), batch_size=None):
            with torch.no_grad():
                model(batch)
        model.train()
        return (time.perf_counter() - started) * 1e3

    with probe:
        model(torch.randn(4))
    evaluated_ms = evaluate()
    with probe:
        model(torch.randn(4))
    final_ms = evaluate() + evaluate()
    torch.save({}, io.BytesIO())
    torch.save({}, io.BytesIO())
    first, _ = records(probe)
    probe.goodbye(exit_code=0)
    (goodbye,) = [item for item in probe.sender.raw if type(item) is dict]
    # The fetches between the regions (and before the first) are evaluation's, not input wait.
    assert first.input_wait_ms < 1.0 and first.eval_ms >= 3 * (5 + 2)
    assert first.eval_ms == pytest.approx(evaluated_ms, rel=0.1)
    assert goodbye["tail_eval_ms"] == pytest.approx(final_ms, rel=0.1) and goodbye["tail_counts"] == [2, 2]


class Sampler(nn.Module):
    """Trains through forward; samples through its inner network, never through itself."""

    def __init__(self, sleep_ms):
        super().__init__()
        self.net = SlowForward(sleep_ms=sleep_ms)

    def forward(self, inputs):
        return self.net(inputs)

    @torch.no_grad()
    def generate(self, inputs, calls):
        for _ in range(calls):
            inputs = torch.cat([inputs[:, 1:], self.net(inputs)[:, :1]], dim=1)
            time.sleep(0.005)  # the sampling around the network's calls: evaluation too
        return inputs


def test_no_grad_regions_between_steps_are_evaluation_when_the_model_runs_in_them(probe, patches):
    from torch.nn.modules import module as torch_module

    model = Sampler(sleep_ms=5)
    ema, foreign = copy.deepcopy(model.net).requires_grad_(False), nn.Linear(3, 5)
    patches.hook_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    has_any_global_hook = torch_module._has_any_global_hook
    inputs = torch.randn(2, 4)
    hooks_seen = []

    def train():
        with probe:
            with torch.no_grad():  # inside a step: no region, no hook
                hooks_seen.append(len(torch_module._global_forward_pre_hooks))
            model(inputs).sum().backward()
            optimizer.step()

    train()
    with torch.no_grad():  # the inner network, twice, each time nested in generate's own no_grad
        model.generate(inputs, 2)
        hooks_seen.append(len(torch_module._global_forward_pre_hooks))  # gone once the model ran
        model.generate(inputs, 2)
    train()
    with torch.no_grad():  # an EMA update: no module runs
        for averaged, current in zip(ema.parameters(), model.net.parameters()):
            averaged.lerp_(current, 0.5)
        time.sleep(0.01)
    with torch.inference_mode():  # someone else's module
        foreign(torch.randn(2, 3))
        time.sleep(0.01)
    train()
    with torch.inference_mode():  # the EMA copy: no parameter shared, its shapes the inner network's
        ema(inputs)
        time.sleep(0.01)
    train()
    sampled, updated, copied, last = records(probe)
    assert sampled.eval_ms >= 2 * 2 * (5 + 5) and sampled.forward_calls == 1
    assert sampled.eval_ms <= beside_ms(sampled, updated) + 0.01  # the nested regions counted once
    assert updated.eval_ms == 0.0 and updated.outside_ms >= 20.0
    assert copied.eval_ms >= 5 + 10 and copied.eval_ms <= beside_ms(copied, last) + 0.01
    assert last.eval_ms == 0.0
    assert hooks_seen == [0, 0, 0, 0, 0] and not torch_module._global_forward_pre_hooks
    assert torch_module._has_any_global_hook is has_any_global_hook
    patches.remove()
    grad_modes = (torch.no_grad, torch.inference_mode, torch.set_grad_enabled)
    assert all("traceml" not in method.__code__.co_filename
               for manager in grad_modes for method in (manager.__enter__, manager.__exit__))


def test_steps_traceml_slows_on_purpose_are_marked(probe, patches):
    from traceml.probe.layers import LayerProbe

    model = SlowForward()
    patches.hook_model(model)
    probe.layers = LayerProbe(probe, model, every_n_steps=4)
    for _ in range(9):
        with probe:
            model(torch.randn(2, 4)).sum().backward()
    marked = [record.step for record in records(probe) if record.instrumented]
    assert marked == [4, 8]  # sampled every 4th step (not the first); the FLOPs come from those


def test_an_evaluations_copy_to_the_device_starts_no_inferred_step(probe, patches):
    model = SlowForward(sleep_ms=5)
    patches.hook_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe.auto_steps = True  # steps inferred: a batch's copy to the device starts one
    probe._grad_enabled = torch.is_grad_enabled  # as process.py sets it
    for step in range(3):
        torch.randn(2, 4).to("meta")  # the training batch's copy: the step starts here
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        if step == 0:
            with torch.no_grad():  # an evaluation loop: its batches' copies are not steps
                for _ in range(2):
                    torch.randn(2, 4).to("meta")
                    model(torch.randn(2, 4))
    first, second, _ = records(probe)
    # The evaluation is the first step's, outside its work; the second step's forward is its
    # own call alone. (Not compared by time: beside a busy core a 5 ms sleep wakes 25 ms late.)
    assert first.eval_ms >= 2 * 5 and first.eval_ms <= beside_ms(first, second) + 0.01
    assert second.forward_calls == 1 and second.eval_ms == 0


def test_an_inferred_step_that_never_ends_leaves_the_step_before_as_it_was(probe, patches):
    model = SlowForward()
    patches.hook_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe.auto_steps = True  # steps inferred: each ends at optimizer.step()
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        time.sleep(0.005)
    time.sleep(0.05)  # the script's tail: saving, printing
    model(torch.randn(2, 4))  # a forward with gradients on after the last update: not a step
    time.sleep(0.05)
    steps = records(probe)
    assert [s.step for s in steps] == [0, 1, 2]
    assert all(s.outside_ms >= 5.0 for s in steps[:2])  # the windows between updates, whole
    assert steps[2].outside_ms == 0.0  # the last one ends where it ended, not at the tail's start


def test_host_rss_has_a_reading_before_the_senders_first_round():
    """Beside a busy loop the first steps once ended before the sender's first round and
    recorded no RSS; the reading taken when the probe starts is theirs."""
    from traceml.probe.memory import HostRss

    assert HostRss().latest_bytes > 10 * 2 ** 20  # this process, torch imported
