"""Every finding kind's sentence, made by its rule's pure function, checks against its evidence
(tests/sentences.py); and the checker fails a sentence that states what its evidence does not give."""
import copy

import msgspec
import pytest

from sentences import FIGURES, problems
from test_diagnose import busy_machine, evaluated_window, memory_window, planned_window, rolled, stalled_window, window
from test_goodput import goodput_of
from test_hangs import progress, pulse
from test_stragglers import rank_row
from traceml.analysis.loaders import LoaderFigures
from traceml.analysis.rollup import Window
from traceml.diagnose import DiagnosisInput, diagnose
from traceml.diagnose.hangs import find_hang, rank_lost
from traceml.diagnose.host_sync import host_sync
from traceml.diagnose.memory import MemoryLimits, memory_creep, memory_pressure, out_of_memory
from traceml.diagnose.run_time import recompilations, slow_startup
from traceml.diagnose.spikes import Stalls, planned_work, step_spikes
from traceml.diagnose.step_time import input_bound, insufficient_data
from traceml.diagnose.stragglers import comm_bound, straggler
from traceml.records import (STEPS_FROM_BACKWARD, CompileRecord, FindingKind, HostSyncSample, OomRecord,
                             SyncSite)

GIB = 2 ** 30


def as_summary(finding) -> dict:
    """A finding as final_summary.json keeps it."""
    return msgspec.to_builtins(finding)


def loader(**figures) -> LoaderFigures:
    base = dict(num_workers=2, pin_memory=False, persistent_workers=False, prefetch_factor=2, batch_size=32,
                device="cpu", usable_cores=4, iterators_made=3, batches_measured=100, batches_per_step=1.0,
                worker_cpu_ms_per_batch=12.0, workers_busy_share=0.83, workers_cpu_wait_share=0.04,
                ready_share=0.3)
    return LoaderFigures(**{**base, **figures})


def spiky(extra_ms, slow_steps, outlier_ms=0.0, **where_ms) -> Window:
    steps = stalled_window(slow_steps, extra_ms=extra_ms, **where_ms).steps
    if outlier_ms:
        steps[49].step_ms += outlier_ms
        steps[49].untraced_ms += outlier_ms
    return Window(steps)


def waiting_in_collectives(steps: Window) -> Window:
    for step in steps.steps:
        step.comm_wait_ms = 3.3  # of backward's 30.4 ms
    return Window(steps.steps)


def frozen(rank_progress):
    rank_progress.last_heard_unix_s = 1000.0 - 30  # no word for 30 s: frozen
    return rank_progress


def bigger_batches() -> Window:
    """Every 10th batch 8 times larger, its forward and backward 5 times longer."""
    steps = [rolled(index, backward=30.0, optimizer=10.0) for index in range(100)]
    for step in steps[9::10]:
        step.forward_ms, step.backward_ms, step.samples = 5 * step.forward_ms, 5 * step.backward_ms, 64
        step.step_ms = step.forward_ms + step.backward_ms + step.optimizer_ms
    return Window(steps)


def compiles():
    first = CompileRecord(rank=0, step=0, start_unix_s=0.0, duration_ms=900.0, compile_id="0/0", trigger="dynamo")
    reasons = ["0/0: tensor 'args[0]' size mismatch at index 1. expected 8, actual 9", "0/0: L['n'] == 3"]
    return [first] + [CompileRecord(rank=0, step=20 + i, start_unix_s=0.0, duration_ms=412.5, compile_id=f"0/{i + 1}",
                                    trigger="dynamo", recompile_reason=reasons[i % 2]) for i in range(5)]


def sync_samples():
    sites = [SyncSite(site="train.py:57", code="loss.item()", call="Tensor.item", calls=20, wait_ms=63.0),
             SyncSite(site="train.py:61", code="print(acc)", call="Tensor.__repr__", calls=20, wait_ms=17.3)]
    return [HostSyncSample(rank=0, first_step=10, steps=20, sites=sites)]


def ledger_row():
    return [{"rank": 0, "held": int(7.1 * GIB), "parameters": {"frozen": 0, "trainable": int(1.2 * GIB)},
             "gradients": int(1.2 * GIB), "optimizer_state": int(2.4 * GIB), "activations": int(2.1 * GIB),
             "rest": int(0.2 * GIB), "cache": None}]


# Each kind, from its rule's pure function, in each of the forms its words take.
CASES = {
    "INSUFFICIENT_DATA, a few steps": lambda: insufficient_data(3),
    "INSUFFICIENT_DATA, none": lambda: insufficient_data(0),
    "INPUT_BOUND, no loader": lambda: diagnose(DiagnosisInput(window(input_wait=31.37), steps_seen=20))[0],
    "INPUT_BOUND, at the line": lambda: input_bound(window(input_wait=10.0)),
    "INPUT_BOUND, workers behind": lambda: input_bound(window(input_wait=23.4), loader()),
    "INPUT_BOUND, workers waiting": lambda: input_bound(window(input_wait=23.4), loader(workers_busy_share=0.2)),
    "INPUT_BOUND, hand-over": lambda: input_bound(window(input_wait=23.4), loader(ready_share=0.95,
                                                                                 worker_cpu_ms_per_batch=4.1)),
    "INPUT_BOUND, near hand-over": lambda: input_bound(window(input_wait=13.0), loader(ready_share=0.95,
                                                                                      worker_cpu_ms_per_batch=20.0)),
    "INPUT_BOUND, no workers": lambda: input_bound(window(input_wait=23.4), loader(num_workers=0)),
    "INPUT_BOUND, unmeasured": lambda: input_bound(window(input_wait=23.4), loader(ready_share=None)),
    "INPUT_BOUND, a thread behind": lambda: input_bound(window(input_wait=30.0), loader(
        num_workers=0, thread_ms_per_batch=100.0)),
    "INPUT_BOUND, a thread held up": lambda: input_bound(window(input_wait=30.0), loader(
        num_workers=0, thread_ms_per_batch=20.0)),
    "INPUT_BOUND, on a GPU": lambda: input_bound(window(input_wait=23.4), loader(device="cuda:0")),
    "H2D_BOUND": lambda: diagnose(DiagnosisInput(window(h2d=17.77), steps_seen=20))[0],
    "UNTRACED_WORK, between steps": lambda: diagnose(DiagnosisInput(window(outside=41.3), steps_seen=20))[0],
    "UNTRACED_WORK, inside the step": lambda: diagnose(DiagnosisInput(window(untraced=55.55), steps_seen=20))[0],
    "UNTRACED_WORK, steps by backward": lambda: diagnose(DiagnosisInput(
        window(outside=35.0), steps_seen=20, steps_found_by=STEPS_FROM_BACKWARD))[0],
    "UNTRACED_WORK, every 20 steps": lambda: diagnose(DiagnosisInput(
        stalled_window({19, 39, 59, 79, 99}, extra_ms=1000.0), steps_seen=100))[0],
    "UNTRACED_WORK, every 10 steps, one ten times longer": lambda: next(
        f for f in diagnose(DiagnosisInput(spiky(150.0, set(range(9, 100, 10)), 1850.0), steps_seen=100))
        if f.kind == "UNTRACED_WORK"),
    "GC_PRESSURE": lambda: diagnose(DiagnosisInput(window(gc=14.2), steps_seen=20))[0],
    "COMPUTE_BOUND": lambda: diagnose(DiagnosisInput(window(backward=30.4, optimizer=5.4), steps_seen=20))[0],
    "COMPUTE_BOUND, less its wait in collectives": lambda: diagnose(DiagnosisInput(
        waiting_in_collectives(window(backward=30.4, optimizer=5.4)), steps_seen=20))[0],
    "EVAL_HEAVY, an outlier": lambda: planned_work(evaluated_window(
        {**{i: 36.0 for i in range(9, 100, 10)}, 49: 402.0}))[0],
    "CHECKPOINT_STALL, every 20 steps": lambda: planned_work(planned_window(
        "checkpoint", {i: 250.0 for i in range(19, 100, 20)}, 100, 100.0))[0],
    "STEP_SPIKES, one step": lambda: step_spikes(Stalls(stalled_window({50}, extra_ms=1000.0))),
    "STEP_SPIKES, in a row": lambda: step_spikes(Stalls(stalled_window(range(50, 56)))),
    "STEP_SPIKES, an outlier": lambda: step_spikes(Stalls(spiky(150.0, set(range(9, 100, 10)), 1850.0))),
    "STEP_SPIKES, the machine": lambda: step_spikes(Stalls(
        stalled_window({23, 41, 42, 58, 67, 88}, extra_ms=250.0, forward=0.6, backward=0.3, optimizer=0.1),
        busy_machine())),
    "STEP_SPIKES, bigger batches": lambda: diagnose(DiagnosisInput(bigger_batches(), steps_seen=100))[0],
    "GC_PRESSURE, every 10 steps": lambda: diagnose(DiagnosisInput(
        stalled_window(set(range(9, 100, 10)), extra_ms=400.0, gc=1.0), steps_seen=100))[0],
    "RECOMPILATION": lambda: recompilations(compiles(), after_step=5, run_ms=31_400.0),
    "SLOW_STARTUP, imports": lambda: slow_startup(goodput_of(startup_s=25.0, wall_s=100.0, imports_ms=18_040.0)),
    "SLOW_STARTUP, setup": lambda: slow_startup(goodput_of(startup_s=50.0, wall_s=100.0, imports_ms=1000.0)),
    "HOST_SYNC": lambda: host_sync(sync_samples(), window(outside=12.0)),
    "MEMORY_CREEP": lambda: memory_creep(memory_window([GIB + i * 3 * 2 ** 20 for i in range(40)]),
                                         MemoryLimits(device_capacity_bytes=8 * GIB)),
    "MEMORY_CREEP, its part and layers": lambda: memory_creep(
        memory_window([GIB + i * 3 * 2 ** 20 for i in range(40)]), MemoryLimits(device_capacity_bytes=8 * GIB),
        [{"name": "encoder.layer.3", "alive_bytes": 24 * 2 ** 20}], [{"rank": 0, "growth": {"activations": 110 * 2 ** 20}}]),
    "MEMORY_PRESSURE": lambda: memory_pressure(window(), MemoryLimits(device_capacity_bytes=8 * GIB),
                                               int(7.6 * GIB), None, ledger_row()),
    "MEMORY_PRESSURE, out of memory": lambda: out_of_memory(OomRecord(
        rank=1, step=12, phase="backward", layer="fc1", message="CUDA out of memory", allocated_bytes=int(7.5 * GIB),
        reserved_bytes=int(7.9 * GIB), peak_bytes=int(7.8 * GIB), largest_layers=[("fc1", 3 * 2 ** 28)]),
        MemoryLimits(device_capacity_bytes=8 * GIB)),
    "INPUT_STRAGGLER": lambda: straggler([rank_row(0, comm_wait=7.2), rank_row(1, comm_wait=0.4, input_wait=6.9,
                                                                             behind=0.9)], 20.0),
    "COMPUTE_STRAGGLER": lambda: straggler([rank_row(0, comm_wait=6.0), rank_row(1, comm_wait=0.5, forward=8.7,
                                                                               behind=0.95)], 20.0, 1.5),
    "STRAGGLER": lambda: straggler([rank_row(0, comm_wait=6.0, cpu_wait=0.1), rank_row(
        1, comm_wait=0.5, behind=0.95, cpu_wait=5.3)], 20.0),
    "COMM_BOUND, FSDP": lambda: comm_bound([rank_row(0, comm_wait=6.35, forward_comm_wait=2.45),
                                            rank_row(1, comm_wait=6.9, forward_comm_wait=2.5)], 20.0, "FSDP2"),
    "COMM_BOUND, DDP": lambda: comm_bound([rank_row(0, comm_wait=6.3), rank_row(1, comm_wait=6.9)], 20.0),
    "HANG": lambda: find_hang([
        progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce", collectives_issued=41)),
        progress(1, stalled_s=40, pulse=pulse(1, 40, phase="in step", collectives_issued=39)),
        progress(2, stalled_s=40, pulse=pulse(2, 40, waiting_in="DataLoader", loader_worker=1,
                                              loader_worker_pid=4242, loader_worker_state="sleeping"))],
        1000.0).finding,
    "HANG, gone and frozen": lambda: find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce")),
                                                progress(1, stalled_s=40, gone=True),
                                                frozen(progress(2, stalled_s=40))], 1000.0).finding,
    "RANK_LOST, an exit status": lambda: rank_lost([{"rank": 0, "from_step": 0, "exit_code": 3, "pid": 4711}], {}, 1),
    "RANK_LOST": lambda: rank_lost([{"rank": 1, "from_step": 30, "exit_code": -9, "pid": 4711},
                                    {"rank": 3, "from_step": 28, "exit_code": -9, "pid": 4713}],
                                   {1: {"exit_code": -9}, 3: {"exit_code": -9}, 0: {"exit_code": -15}}, 4),
}


@pytest.mark.parametrize("case", CASES)
def test_every_figure_of_each_kinds_sentence_follows_from_its_evidence(case):
    finding = CASES[case]()
    assert finding is not None and case.startswith(finding.kind), finding
    assert problems(as_summary(finding)) == []


def test_every_kind_has_an_entry_and_a_case():
    assert set(FIGURES) == set(FindingKind)
    covered = {case.split(",")[0] for case in CASES}
    assert covered == set(FindingKind)


@pytest.mark.parametrize("evaluations_ms", [
    {i: 36.0 for i in range(9, 100, 10)},
    {**{i: 36.0 for i in range(9, 100, 10)}, 49: 402.0},
    {10: 3000.0}])
def test_planned_work_states_its_parts_its_total_and_the_runs_length(evaluations_ms):
    (finding,) = [f for f in planned_work(evaluated_window(evaluations_ms)) if f.kind == "EVAL_HEAVY"]
    assert problems(as_summary(finding)) == []


TARGET = {"kind": "EVAL_HEAVY", "rank": None,
          "summary": "evaluated 5 times: 4 of about 36 ms, one of 402 ms at step 500, and 402 ms elsewhere: 948 ms, "
                     "3.2% of the 29.4 s run",
          "evidence": {"count": 5, "each_ms": 36.0, "outliers": [{"step": 500, "ms": 402.0}], "elsewhere_ms": 402.0,
                       "total_ms": 948.0, "share": 0.0322, "run_s": 29.41, "period_steps": None}}


def test_the_planned_work_entry_takes_the_form_it_is_reworded_to():
    assert problems(TARGET) == []
    short = copy.deepcopy(TARGET)
    short["summary"] = short["summary"].replace("948 ms", "984 ms")
    short["evidence"]["total_ms"] = 984.0
    assert any("planned work's parts" in problem for problem in problems(short))


def test_a_figure_the_evidence_does_not_give_fails():
    finding = as_summary(CASES["COMPUTE_BOUND"]())
    assert problems(finding) == []
    broken = copy.deepcopy(finding)
    broken["summary"] = broken["summary"].replace(" ms of ", " ms of 1", 1)  # "of 100.0 ms" -> "of 1100.0 ms"
    said = problems(broken)
    assert any("'1100.0 ms' follows from no evidence" in problem for problem in said), said
    assert any("share of the step" in problem for problem in said), said


def test_parts_that_do_not_add_up_fail():
    finding = as_summary(CASES["STEP_SPIKES, an outlier"]())
    assert problems(finding) == []
    broken = copy.deepcopy(finding)
    # The outlier's time is in the evidence; the cost no longer adds the nine typical steps' excess.
    broken["summary"] = broken["summary"].replace("9 of about 250.0 ms", "9 of about 200.0 ms")
    broken["evidence"]["spike_median_ms"] = 200.0
    assert any("slow steps' excess" in problem for problem in problems(broken))


def test_a_share_without_its_base_fails():
    finding = as_summary(CASES["RECOMPILATION"]())
    assert problems(finding) == []
    broken = copy.deepcopy(finding)
    broken["summary"] = broken["summary"].replace(" of the 31.4 s run", " of the run")
    assert any("no recompilation time with its base" in problem for problem in problems(broken))


def test_a_kind_without_an_entry_fails():
    assert problems({"kind": "NEW_KIND", "summary": "3 of 4", "evidence": {}}) != []


def test_startup_parts_add_up_before_the_code_that_says_where_the_same_seconds_went():
    finding = {"kind": "SLOW_STARTUP", "rank": None,
               "summary": "startup takes 13.5 s, 22% of the 60.7 s run, before the first step: the script's imports "
                          "13.3 s (torch the slowest), building the model and data 0.2 s; 7.1 s in train_loop.py:57 "
                          "main, 0.1 s in synthetic_data.py:11 __init__, 1,806 modules imported",
               "evidence": {"share": 0.2224, "seconds": 13.5, "run_s": 60.7, "imports_s": 13.3, "setup_s": 0.2,
                            "first_compilation_s": None, "first_batch_s": None, "slowest_import": "torch",
                            "modules_imported": 1806, "code_1": "train_loop.py:57 main", "code_1_s": 7.1,
                            "code_2": "synthetic_data.py:11 __init__", "code_2_s": 0.1}}
    assert problems(finding) == []
    miscounted = copy.deepcopy(finding)
    miscounted["summary"] = miscounted["summary"].replace("1,806", "1,807")
    assert any("'1,807' follows from no evidence" in problem for problem in problems(miscounted))
