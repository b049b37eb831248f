"""The training DataLoader as TraceML sees it: which iterators the probe notes, what the sender's
watch reads of them (settings, batches, the workers' CPU time, batches waiting made), the figures
the analysis makes of that, and the advice INPUT_BOUND gives from them."""
import gc
import json
import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, dataloader

from traceml.analysis.loaders import loader_figures
from traceml.analysis.rollup import Window
from traceml.diagnose import DiagnosisInput, diagnose
from traceml.probe.loaders import LoaderWatch, worker_times
from traceml.probe.patches import Patches
from traceml.probe.patches.first_call import FirstModelCall
from traceml.probe.step_state import INPUT_WAIT_GAP_NS, INPUT_WAIT_NS
from traceml.probe.step import StepProbe
from traceml.records import LoaderSample, RankHello
from conftest import SCRIPTS
from test_diagnose import rolled

FIELD = Path(__file__).parent / "field"


class WatchedSender:
    def __init__(self):
        self.raw = []
        self.loaders = LoaderWatch(rank=0)

    def push(self, item):
        self.raw.append(item)


@pytest.fixture
def patches():
    originals = (dataloader._BaseDataLoaderIter.__next__, dataloader._BaseDataLoaderIter.__init__, queue.Queue.get)
    patches = Patches(StepProbe(WatchedSender()), FirstModelCall())  # each test installs them
    yield patches
    patches.remove()
    assert (dataloader._BaseDataLoaderIter.__next__, dataloader._BaseDataLoaderIter.__init__,
            queue.Queue.get) == originals


@pytest.fixture
def probe(patches):
    return patches.probe


def noted(probe):
    return [watched.ref() for watched in probe.sender.loaders._watched]


def small_loader(**options):
    return DataLoader(TensorDataset(torch.arange(64.0).reshape(32, 2)), batch_size=4, **options)


def test_the_iterator_a_loop_was_already_in_is_noted_at_its_next_batch_then_only_timed(probe, patches):
    batches = iter(small_loader())  # a `for` loop makes it before the first step attaches TraceML
    patches.install()
    assert dataloader._BaseDataLoaderIter.__dict__["__next__"].__name__ == "first_next"
    next(batches)
    assert noted(probe) == [batches]
    # From the second batch on, the timer alone runs: nothing of the watch is on the batch's path.
    assert dataloader._BaseDataLoaderIter.__dict__["__next__"].__name__ == "__next__"
    next(batches)
    assert noted(probe) == [batches]


def test_iterators_made_later_are_noted_when_made_and_an_evaluations_are_not(probe, patches):
    patches.install()
    training, evaluation = small_loader(), small_loader()
    epoch = iter(training)
    with torch.no_grad():
        evaluated = iter(evaluation)
        next(evaluated)
    assert noted(probe) == [epoch]


class SlowDataset(TensorDataset):
    """Each sample takes sample_s to make (a sleep: another thread runs meanwhile)."""

    def __init__(self, sample_s=0.005):
        super().__init__(torch.arange(64.0).reshape(32, 2))
        self.sample_s = sample_s

    def __getitem__(self, index):
        time.sleep(self.sample_s)
        return super().__getitem__(index)


def input_wait_ms(probe):
    return (probe.sums[INPUT_WAIT_NS] + probe.window[INPUT_WAIT_GAP_NS]) / 1e6


def test_a_loader_iterated_on_a_thread_is_that_threads_cost_and_the_block_on_its_queue_the_wait(probe, patches):
    patches.install()
    batches = iter(DataLoader(SlowDataset(), batch_size=4))  # noted here; iterated on the thread
    made = queue.Queue(maxsize=1)
    filler = threading.Thread(target=lambda: [made.put(batch) for batch in batches])
    filler.start()
    own_ms = 0.0
    for _ in range(8):  # 10 ms of training a batch, while the thread makes the next in 20 ms
        started = time.perf_counter()
        made.get()
        own_ms += (time.perf_counter() - started) * 1e3
        time.sleep(0.01)
    filler.join()
    # The training's wait is its block on the queue (about 20 + 7 * 10 ms), never the thread's
    # DataLoader time (8 * 20 ms).
    (watched,) = probe.sender.loaders._watched
    thread_ms = watched.thread_next_ns / 1e6
    assert 0.9 * own_ms <= input_wait_ms(probe) <= own_ms and own_ms > 40
    assert thread_ms >= 8 * 4 * 5 and thread_ms > own_ms + 40
    (sample,) = probe.sender.loaders.samples(final=True)
    assert sample.batches == 8 and sample.thread_next_s == pytest.approx(watched.thread_next_ns / 1e9)


def test_a_queue_get_inside_the_loaders_next_or_on_another_thread_is_not_counted_again(probe, patches):
    patches.install()
    made = queue.Queue()

    class FromQueue(TensorDataset):
        def __getitem__(self, index):
            return made.get()  # on the training thread, inside the DataLoader's timed __next__

    threading.Thread(target=lambda: [time.sleep(0.01) or made.put(torch.zeros(2)) for _ in range(8)]).start()
    started = time.perf_counter()
    for _ in DataLoader(FromQueue(torch.zeros(8)), batch_size=4):
        pass
    own_ms = (time.perf_counter() - started) * 1e3
    assert 0.5 * own_ms <= input_wait_ms(probe) <= own_ms and own_ms > 60  # once, not twice
    before_ms = input_wait_ms(probe)

    def blocked_get():  # another thread's wait is its own
        try:
            made.get(timeout=0.05)
        except queue.Empty:
            pass

    other = threading.Thread(target=blocked_get)
    other.start()
    other.join()
    assert input_wait_ms(probe) == before_ms


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
            batch_size=16, seconds=40.0, cpu_wait_s=0.0, thread_s=0.0):
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
                              worker_cpu_wait_s=cpu_wait_s, thread_next_s=thread_s, **common)]
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
    # Iterated on a thread ahead of the training (70 ms of training a batch): that thread's time a
    # batch without workers; with workers, the workers' figures, wherever the iterator runs.
    (dict(num_workers=0, thread_s=3.9), "cpu", "thread_behind",
     ["worker processes", "num_workers on the DataLoader the thread iterates"], ["Set num_workers", "buffer"]),
    (dict(num_workers=0, thread_s=0.78), "cpu", "thread_held_up", ["a larger buffer", "worker processes"], []),
    (dict(cpu_s=60.0, with_a_batch=20, thread_s=3.9), "cpu", "per_sample_work", ["Raise num_workers"], []),
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


def test_a_thread_behind_the_training_is_told_with_both_times_a_batch():
    window = window_of()
    finding = input_bound_of(window, loader_figures(samples(num_workers=0, thread_s=3.9), window, hellos()))
    assert ("DataLoader(num_workers=0, batch_size=16) iterated on a thread ahead of the training, training on the "
            "CPU") in finding.summary
    assert "a thread makes each batch in 100.0 ms, more than the 70.0 ms the training spends on one" in finding.summary
    assert finding.evidence["thread_ms_per_batch"] == pytest.approx(100.0)
    assert finding.evidence["training_ms_per_batch"] == pytest.approx(70.0)


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


def own_input_wait_share(timed, warmup):
    """The script's own input wait over its steps after the warm-up, as TraceML splits time: a
    step's window runs from its start to the next one's, and holds the fetch of the next batch."""
    fetch_s, enter_s, exit_s = timed["fetch_s"], timed["enter_s"], timed["exit_s"]
    last = len(enter_s) - 1
    waited_s = sum(fetch_s[step + 1] for step in range(warmup, last))
    return waited_s / (enter_s[last] - enter_s[warmup] + exit_s[last] - enter_s[last])


@pytest.mark.parametrize("loader", ["monai", "queue"])
@pytest.mark.parametrize("make_ms, keeps_up", [(5, True), (40, False)])
def test_a_prefetching_threads_batches_are_waited_for_as_the_script_itself_times_it(traceml_run, tmp_path, loader,
                                                                                   make_ms, keeps_up):
    """MONAI's ThreadDataLoader and a hand-written prefetcher iterate their DataLoader on a thread
    into a buffer: the input wait is the training's own block on that buffer (the script's timing
    of its next() calls), never the thread's DataLoader time; INPUT_BOUND only where the thread
    falls behind the ~20 ms step, with what the thread spends on a batch."""
    own = tmp_path / "own.json"
    run = traceml_run("--loader", loader, "--make-ms", make_ms, "--out", own, script=SCRIPTS / "thread_prefetch.py")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.summary()
    own_share = own_input_wait_share(json.loads(own.read_text()), summary["steps"]["warmup_excluded"])
    assert summary["phases"]["input_wait"]["share"] == pytest.approx(own_share, abs=0.03)
    # The verdict over the steps: a startup slowed by a busy machine (imports of 40 s seen) may
    # outweigh them in a run this short.
    verdict = next(finding for finding in summary["findings"] if finding["kind"] != "SLOW_STARTUP")
    bound = [finding for finding in summary["findings"] if finding["kind"] == "INPUT_BOUND"
             and finding["severity"] != "info"]
    if keeps_up:
        assert verdict["kind"] != "INPUT_BOUND" and not bound, summary["findings"]
        return
    assert own_share > 0.3 and verdict == bound[0]
    evidence = verdict["evidence"]
    assert evidence["loader_cause"] == "thread_behind" and evidence["num_workers"] == 0
    assert evidence["thread_ms_per_batch"] >= make_ms > evidence["training_ms_per_batch"]
    assert "iterated on a thread ahead of the training" in verdict["summary"]
    assert "num_workers on the DataLoader the thread iterates" in verdict["action"]
