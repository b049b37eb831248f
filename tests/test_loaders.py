"""The training DataLoader as TraceML sees it: which iterators the probe notes, what the sender's
watch reads of them (settings, batches, the workers' CPU time, batches waiting made), the figures
the analysis makes of that, and the advice INPUT_BOUND gives from them."""
import gc
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, dataloader

from traceml.analysis.loaders import loader_figures
from traceml.analysis.rollup import Window
from traceml.diagnose import DiagnosisInput, diagnose
from traceml.probe import phases
from traceml.probe.loaders import LoaderWatch, worker_times
from traceml.probe.step import StepProbe
from traceml.records import LoaderSample, RankHello
from test_diagnose import rolled

FIELD = Path(__file__).parent / "field"


class WatchedSender:
    def __init__(self):
        self.raw = []
        self.loaders = LoaderWatch(rank=0)

    def push(self, item):
        self.raw.append(item)


@pytest.fixture
def probe():
    originals = (dataloader._BaseDataLoaderIter.__next__, dataloader._BaseDataLoaderIter.__init__)
    probe = StepProbe(WatchedSender())
    yield probe
    phases.remove_patches()
    assert (dataloader._BaseDataLoaderIter.__next__, dataloader._BaseDataLoaderIter.__init__) == originals


def noted(probe):
    return [watched.ref() for watched in probe.sender.loaders._watched]


def small_loader(**options):
    return DataLoader(TensorDataset(torch.arange(64.0).reshape(32, 2)), batch_size=4, **options)


def test_the_iterator_a_loop_was_already_in_is_noted_at_its_next_batch_then_only_timed(probe):
    batches = iter(small_loader())  # a `for` loop makes it before the first step attaches TraceML
    phases.install_patches(probe)
    assert dataloader._BaseDataLoaderIter.__dict__["__next__"].__name__ == "first_next"
    next(batches)
    assert noted(probe) == [batches]
    # From the second batch on, the timer alone runs: nothing of the watch is on the batch's path.
    assert dataloader._BaseDataLoaderIter.__dict__["__next__"].__name__ == "__next__"
    next(batches)
    assert noted(probe) == [batches]


def test_iterators_made_later_are_noted_when_made_and_an_evaluations_are_not(probe):
    phases.install_patches(probe)
    training, evaluation = small_loader(), small_loader()
    epoch = iter(training)
    with torch.no_grad():
        evaluated = iter(evaluation)
        next(evaluated)
    assert noted(probe) == [epoch]


def test_the_watch_reads_settings_batches_and_worker_cpu_and_lets_the_iterator_go():
    watch = LoaderWatch(rank=3)
    loader = DataLoader(TensorDataset(torch.randn(256, 8)), batch_size=4, num_workers=2, pin_memory=True,
                        prefetch_factor=3)
    batches = iter(loader)
    watch.note(batches)
    next(batches)
    (first,) = watch.samples(final=True)  # the sender's first reading after the first batch
    for _ in range(39):
        next(batches)
        watch.read_ready()
    workers = [process.pid for process in batches._workers]
    (sample,) = watch.samples(final=True)
    assert first.batches == 1 and first.ready_readings == 0
    assert isinstance(sample, LoaderSample) and sample.rank == 3 and sample.loader == 0
    # pin_memory=True pins nothing without an accelerator: the watch says what the loader does.
    assert (sample.num_workers, sample.pin_memory, sample.persistent_workers, sample.prefetch_factor,
            sample.batch_size) == (2, torch.accelerator.is_available(), False, 3, 4)
    assert sample.batches == 40
    assert sample.worker_cpu_s == pytest.approx(sum(worker_times(pid)[0] for pid in workers), abs=0.05)
    assert sample.worker_cpu_s > 0
    assert sample.ready_readings == 39 and sample.ready_readings_with_a_batch <= 39
    assert sample.usable_cores >= 1
    assert watch.samples(final=True) == []  # nothing handed over since: nothing to send
    del batches
    gc.collect()
    assert watch.samples(final=True) == [] and watch._watched == []  # held weakly: gone with the loop's
    assert all(worker_times(pid) is None for pid in workers)  # and its workers with it


def window_of(steps=40):
    """100 ms steps (rolled() starts one a second from t=0), 30 ms of each the input wait."""
    return Window([rolled(i, input_wait=30.0) for i in range(steps)])


def samples(num_workers=2, batches=39, cpu_s=0.0, readings=400, with_a_batch=0, iterators=1, pin_memory=False,
            batch_size=16, seconds=40.0, cpu_wait_s=0.0):
    """Two readings of each iterator, `seconds` apart: the figures measured between them."""
    made = []
    for loader in range(iterators):
        start = loader * seconds
        common = dict(rank=0, loader=loader, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=False, prefetch_factor=2 if num_workers else None,
                      batch_size=batch_size, usable_cores=8)
        made += [LoaderSample(unix_s=start + 0.5, batches=4, worker_cpu_s=1.0, ready_readings=10,
                              ready_readings_with_a_batch=5, **common),
                 LoaderSample(unix_s=start + seconds - 0.5, batches=4 + batches, worker_cpu_s=1.0 + cpu_s,
                              ready_readings=10 + readings, ready_readings_with_a_batch=5 + with_a_batch,
                              worker_cpu_wait_s=cpu_wait_s, **common)]
    return made


def hellos(device="cpu"):
    return [RankHello(rank=0, local_rank=0, world_size=1, node_rank=0, host="h", pid=1, device=device,
                      device_name=device, device_capacity_bytes=None, torch_version="2.13.0",
                      argv=["train.py"], started_at_unix_s=0.0)]


def test_the_figures_are_measured_between_each_iterators_first_and_last_reading():
    window = window_of(steps=80)
    figures = loader_figures(samples(cpu_s=3.9, with_a_batch=300, iterators=2, cpu_wait_s=15.6), window, hellos())
    assert figures.batches_measured == 78 and figures.iterators_made == 2
    assert figures.batches_per_step == pytest.approx(1.0)  # 39 steps started between each's readings
    assert figures.worker_cpu_ms_per_batch == pytest.approx(100.0)
    assert figures.workers_busy_share == pytest.approx(7.8 / (2 * 39.0 * 2))  # CPU over workers' wall time
    assert figures.workers_cpu_wait_share == pytest.approx(2 * 15.6 / (2 * 39.0 * 2))
    assert figures.ready_share == pytest.approx(0.75)
    assert loader_figures([], window, hellos()) is None


def input_bound_of(window, figures):
    (finding,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=len(window), loader=figures)) if f.kind == "INPUT_BOUND"]
    return finding


@pytest.mark.parametrize("figures, device, cause, says, never", [
    # No workers on the CPU: workers, never pinning (it pins nothing without an accelerator).
    (dict(num_workers=0), "cpu", "no_workers", ["Set num_workers", "8 cores"], ["pin_memory=True"]),
    (dict(num_workers=0), "cuda:0", "no_workers", ["Set num_workers", "pin_memory=True"], []),
    (dict(num_workers=0, pin_memory=True), "cuda:0", "no_workers", ["Set num_workers"], ["pin_memory=True"]),
    # Batches wait made, yet each takes longer to arrive than a worker's CPU to make it.
    (dict(cpu_s=0.975, with_a_batch=380), "cuda:0", "handover",
     ["num_workers=0", "fewer workers", "larger batches"], ["pin_memory=True", "Raise num_workers"]),
    # Batches wait made and arrive about as fast as they cost: check the cost before more workers.
    (dict(cpu_s=40.0, with_a_batch=380), "cpu", "near_handover",
     ["check the per-sample cost", "workers' overhead"], ["Raise num_workers"]),
    (dict(cpu_s=40.0, with_a_batch=380, batch_size=256), "cpu", "near_handover",
     ["check the per-sample cost"], ["workers' overhead", "Raise num_workers"]),
    # Workers behind and on the CPU: more of them, where there are cores for them; none where
    # they wait for a CPU as much (a busy machine: the cores are taken).
    (dict(cpu_s=60.0, with_a_batch=20), "cpu", "per_sample_work", ["Raise num_workers", "__getitem__"], []),
    (dict(cpu_s=25.0, cpu_wait_s=30.0, with_a_batch=20), "cpu", "per_sample_work",
     ["cores are taken", "__getitem__"], ["Raise num_workers"]),
    # Batches waiting made only now and then: the workers keep up only some of the time.
    (dict(cpu_s=60.0, with_a_batch=240), "cpu", "per_sample_work", ["Raise num_workers"], []),
    # Workers behind but idle on the CPU: waiting on something else.
    (dict(cpu_s=2.0, with_a_batch=20), "cpu", "waiting_workers", ["More workers overlap", "storage"], []),
    # Workers started afresh each epoch: keep them.
    (dict(cpu_s=60.0, with_a_batch=20, iterators=3), "cpu", "per_sample_work", ["persistent_workers=True"], []),
    (dict(cpu_s=60.0, with_a_batch=20), "cpu", "per_sample_work", [], ["persistent_workers=True"]),
])
def test_input_bound_advises_what_the_loaders_figures_say_can_help(figures, device, cause, says, never):
    window = window_of(steps=40 * figures.get("iterators", 1))
    finding = input_bound_of(window, loader_figures(samples(**figures), window, hellos(device)))
    assert finding.evidence["loader_cause"] == cause
    for words in says:
        assert words in finding.action
    for words in never:
        assert words not in finding.action
    assert finding.summary.startswith("input wait is 30% of the step: 30.0 ms of 100.0 ms; DataLoader(num_workers=")
    evidence = finding.evidence
    assert evidence["device"] == device and evidence["input_wait_ms_per_batch"] == pytest.approx(30.0)
    for setting in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "batch_size"):
        assert setting in evidence


def test_the_handover_finding_states_both_costs():
    window = window_of()
    finding = input_bound_of(window, loader_figures(samples(cpu_s=0.975, with_a_batch=380), window, hellos()))
    assert ("a batch was waiting made in 95% of readings, yet each takes 30.0 ms to arrive, more than the "
            "25.0 ms of CPU a worker spends making it") in finding.summary
    assert "a batch costs more with workers than without" in finding.summary
    assert "DataLoader(num_workers=2, persistent_workers=False, prefetch_factor=2, batch_size=16) training on " \
           "the CPU" in finding.summary


def test_cheap_batches_cost_more_with_two_workers_than_without(traceml_run):
    """The char-level transformer's windows are cheap to cut: handing each batch over from two
    worker processes costs the training more than making it itself would (measured: 0.4-0.5 ms
    a batch from next() without workers, 2.0-3.7 ms with two, on this project's VM)."""
    run = traceml_run("--out", "out", "--workers", 2, "--steps", 300, script=FIELD / "char_transformer.py",
                      traceml_args=("--mode", "summary"), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    primary = run.summary()["primary_diagnosis"]
    evidence = primary["evidence"]
    assert primary["kind"] == "INPUT_BOUND", primary
    # The hand-over is the wait; near_handover when the wait per batch came out a little under
    # the workers' CPU per batch (seen in 2 of 6 runs on this project's VM): both say fewer workers.
    assert evidence["loader_cause"] in ("handover", "near_handover"), evidence
    assert (evidence["num_workers"], evidence["pin_memory"], evidence["persistent_workers"],
            evidence["prefetch_factor"], evidence["batch_size"], evidence["device"]) == (2, False, False, 2, 16, "cpu")
    if evidence["loader_cause"] == "handover":
        assert evidence["input_wait_ms_per_batch"] > evidence["worker_cpu_ms_per_batch"] > 0
    assert evidence["ready_share"] >= 0.5
    assert "num_workers=0" in primary["action"] and "pin_memory" not in primary["action"]
    assert ("a batch costs more with workers than without" in primary["summary"]
            or "close to what handing a batch over from a worker costs" in primary["summary"])
    card = " ".join(" ".join(line.strip("│ ").split()) for line in run.stdout.splitlines())  # unwrapped
    assert "DataLoader(num_workers=2, persistent_workers=False, prefetch_factor=2, batch_size=16)" in card
