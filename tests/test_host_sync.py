"""HOST_SYNC: the lines of a loop that make the host wait for the GPU, found on sampled steps.

On the CPU the host never waits for a device, so these tests tell the sampler which tensors to
treat as device tensors (0-dim ones: the loss, a norm) and feed the diagnosis what the probe
sends on CUDA. scripts/gpu_check.sh proves it on a real GPU.
"""
import inspect

import pytest
import torch
from torch import nn

from traceml.analysis.rollup import Window
from traceml.collector.store import Store
from traceml.diagnose import DiagnosisInput, diagnose
from traceml.diagnose.host_sync import host_sync, sync_sites
from traceml.probe import syncs
from traceml.probe.patches import Patches
from traceml.probe.patches.dynamo import compiling
from traceml.probe.patches.first_call import FirstModelCall
from traceml.probe.step import StepProbe
from traceml.records import HostSyncSample, SyncSite
from traceml.wire import decode_payload, encode_frame
from traceml.report.summary import RunData, build_summary
from traceml.views.summary import card_text
from test_records import hello, step
from test_summary import FACTS


class ListSender:
    def __init__(self):
        self.raw = []

    def push(self, item):
        self.raw.append(item)


def scalars_are_on_the_device(tensor):
    return tensor.dim() == 0


@pytest.fixture
def patches():
    before = dict(torch.Tensor.__dict__)
    probe = StepProbe(ListSender())
    patches = Patches(probe, FirstModelCall())
    patches.install()
    probe.auto_steps = True  # steps inferred from optimizer.step(), as in zero-code mode
    probe.syncs = syncs.HostSyncSampler(probe.rank, probe.sender.push, on_device=scalars_are_on_the_device)
    yield patches
    patches.remove()
    assert not {name for name in torch.Tensor.__dict__ if torch.Tensor.__dict__[name] is not before.get(name)}


@pytest.fixture
def probe(patches):
    return patches.probe


def loop_with_syncs(patches, steps):
    """A loop that reads its loss every step, its clipped norm's check every step (inside
    torch), and the loss again as a float every other step."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    patches.hook_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped_during_sample = []
    for index in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)  # CLIP
        optimizer.step()
        optimizer.zero_grad()
        logged = [loss.item()]  # ITEM
        if index % 2:
            logged.append(float(loss.detach()))  # FLOAT
        wrapped_during_sample.append("item" in torch.Tensor.__dict__)
    return wrapped_during_sample


def line_of(marker):
    source, first = inspect.getsourcelines(loop_with_syncs)
    return first + next(i for i, text in enumerate(source) if text.rstrip().endswith("# " + marker))


def test_sampled_steps_name_each_syncing_line_with_its_calls(probe, patches):
    wrapped = loop_with_syncs(patches, 25)
    probe.finish()
    samples = [raw for raw in probe.sender.raw if type(raw) is HostSyncSample]
    assert [(s.first_step, s.steps) for s in samples] == [(5, 10)]  # steps 5 to 14, then none until 100
    # The wrappers exist only during the sample: torch is untouched on the other steps.
    assert wrapped == [5 <= index < 15 for index in range(25)]
    sites = {(site.site, site.call): site for site in samples[0].sites}
    here = "tests/test_host_sync.py"
    item = sites[(f"{here}:{line_of('ITEM')}", "Tensor.item")]
    assert (item.calls, item.code) == (10, "logged = [loss.item()]  # ITEM")
    assert sites[(f"{here}:{line_of('FLOAT')}", "Tensor.__float__")].calls == 5
    # clip_grad_norm_'s own `if` on the norm runs inside torch: filed under the user's line.
    clip = sites[(f"{here}:{line_of('CLIP')}", "Tensor.__bool__")]
    assert clip.calls >= 10 and "clip_grad_norm_" in clip.code
    assert not any("traceml" in site.site or "torch" in site.site for site in samples[0].sites)
    assert all(site.wait_ms > 0 for site in samples[0].sites)


def test_a_sample_cut_short_by_the_end_of_the_run_is_sent_with_its_steps(probe, patches):
    loop_with_syncs(patches, 9)  # the sample starts at step 5; the run ends after step 8
    probe.finish()
    samples = [raw for raw in probe.sender.raw if type(raw) is HostSyncSample]
    assert [(s.first_step, s.steps) for s in samples] == [(5, 4)]
    assert "item" not in torch.Tensor.__dict__


def test_samples_come_round_again_and_a_loop_without_syncs_sends_empty_ones():
    assert [syncs.next_sample_start(step) for step in (-1, 4, 5, 99, 100, 999, 1000, 2500)] == [
        5, 5, 100, 100, 1000, 1000, 2000, 3000]
    sent = []
    sampler = syncs.HostSyncSampler(0, sent.append, on_device=scalars_are_on_the_device)
    assert sampler.begin_step(5) == 15
    torch.ones(3).sum()  # no read on the host
    assert sampler.begin_step(15) == 100
    assert sent == [HostSyncSample(rank=0, first_step=5, steps=10, sites=[])]


def window_of(step_ms, input_wait_ms, outside_ms, steps=30):
    records = []
    for index in range(steps):
        record = step(index)
        record.step_ms, record.input_wait_ms, record.outside_ms = step_ms, input_wait_ms, outside_ms
        record.forward_ms = step_ms - input_wait_ms - outside_ms
        records.append(record)
    return Window(records)


def item_sample(rank=0, first_step=5, steps=10, wait_ms=30.0, calls=10):
    return HostSyncSample(rank=rank, first_step=first_step, steps=steps, sites=[
        SyncSite(site="train.py:57", code="total += loss.item()", call="Tensor.item", calls=calls,
                 wait_ms=wait_ms),
        SyncSite(site="train.py:80", code="print(loss)", call="Tensor.__repr__", calls=1, wait_ms=0.5)])


def test_host_sync_names_the_line_and_is_worth_the_host_work_it_keeps_from_overlapping():
    # 10 ms steps, 3 ms a step waiting at train.py:57, 2 ms of loading and logging a step.
    finding = host_sync([item_sample(), item_sample(first_step=100)], window_of(10.0, 1.5, 0.5))
    assert finding.kind == "HOST_SYNC"
    assert finding.summary == ("train.py:57 `total += loss.item()` synchronizes every step: the host "
                               "waits 3.0 ms a step for the GPU, 30% of the 10.0 ms step")
    assert finding.evidence["calls_per_step"] == 1.0 and finding.evidence["wait_ms_per_step"] == 3.0
    assert finding.evidence["share"] == pytest.approx(0.2)  # the 2 ms of host work, not the 3 ms wait
    assert finding.severity == "warn"
    assert "running sum" in finding.action and "2.0 ms a step (20%)" in finding.action
    # The print once in 20 steps is occasional: not told, but listed.
    assert [row["site"] for row in sync_sites([item_sample()])] == ["train.py:57", "train.py:80"]


def test_a_gpu_bound_loop_that_syncs_is_told_but_not_the_verdict():
    # The host waits 8 ms of a 10 ms step, but has nothing of its own to overlap: removing the
    # sync wins little, so the verdict stays COMPUTE_BOUND.
    window = window_of(10.0, 0.05, 0.05)
    findings = diagnose(DiagnosisInput(window, steps_seen=30, host_syncs=[item_sample(wait_ms=80.0)]))
    assert findings[0].kind == "COMPUTE_BOUND"
    told = next(f for f in findings if f.kind == "HOST_SYNC")
    assert told.severity == "info" and told.evidence["share"] == pytest.approx(0.01)
    assert "80%" in told.summary


def test_occasional_reads_are_no_finding():
    assert host_sync([item_sample(calls=2)], window_of(10.0, 1.5, 0.5)) is None


def test_samples_travel_and_are_stored_and_summarised(tmp_path):
    sample = item_sample()
    assert decode_payload(encode_frame([sample])[8:]) == [sample]
    store = Store(str(tmp_path / "telemetry.sqlite"))
    records = [hello()]
    for index in range(40):
        record = step(index)
        record.input_wait_ms, record.forward_ms, record.outside_ms = 1.5, 8.0, 0.5  # 10 ms steps
        records.append(record)
    store.write(records + [sample, item_sample(first_step=100)])
    store.commit()
    assert store.records(HostSyncSample) == [sample, item_sample(first_step=100)]
    summary = build_summary(RunData(store), FACTS)
    assert summary["host_syncs"][0] == {"site": "train.py:57", "code": "total += loss.item()",
                                        "call": "Tensor.item", "calls_per_step": 1.0, "wait_ms_per_step": 3.0,
                                        "ranks": [0], "sampled_steps": 20}
    finding = next(f for f in summary["findings"] if f["kind"] == "HOST_SYNC")
    assert finding["evidence"]["site"] == "train.py:57"
    assert "train.py:57" in card_text(summary)


def test_a_compiled_function_that_reads_values_compiles_once_through_a_sample():
    from torch._dynamo.utils import counters

    def normalised(values):  # graph breaks at the `if` and at .item(), as real code does
        total = values.sum()
        if total > 0:
            values = values / total
        return values * values.mean().item()

    compiled = torch.compile(normalised, backend="aot_eager")
    inputs = torch.rand(16)
    sent = []
    sampler = syncs.HostSyncSampler(0, sent.append, on_device=scalars_are_on_the_device,
                                    is_compiling=compiling())
    for step_index in range(30):
        if step_index in (5, 15):
            sampler.begin_step(step_index)  # the wrappers go in at step 5 and out at step 15
        compiled(inputs)
        if step_index == 2:
            frames = counters["frames"]["total"]
    assert counters["frames"]["total"] == frames  # dynamo compiled nothing more as the wrappers came and went
    calls = {site.call: site.calls for site in sent[0].sites}
    assert calls == {"Tensor.__bool__": 10, "Tensor.item": 10}
