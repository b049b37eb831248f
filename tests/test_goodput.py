"""Goodput (startup, training, evaluation, checkpoint, other) and torch.compile awareness, on real
CPU scripts that measure themselves, and the rules over them on made-up figures."""
import json
import re

import pytest

from conftest import SCRIPTS
from test_field import FIELD
from traceml.analysis.goodput import PARTS, RunTime
from traceml.diagnose.run_time import (STARTUP_MIN_RUN_S, plain_reason, recompilations,
                                       slow_startup)
from traceml.records import CompileRecord, RankEnd, RankHello, StepRecord

EVAL_SAVE = SCRIPTS / "eval_save_loop.py"
COMPILED = SCRIPTS / "compiled_loop.py"
HF = SCRIPTS / "hf_trainer.py"
SAMPLED = FIELD / "sampled_lm.py"


def measured(run):
    line = next(line for line in run.stdout.splitlines() if line.startswith("MEASURED "))
    return json.loads(line[len("MEASURED "):])


def kinds(summary):
    return {f["kind"]: f for f in summary["findings"]}


@pytest.mark.serial  # judges which steps stand out; another test beside it made some (under -n 2)
@pytest.mark.parametrize("mode", [[], ["--trace-step"]], ids=["zero-code", "trace_step"])
def test_evaluation_and_saves_take_the_share_the_script_measures(traceml_run, mode):
    run = traceml_run("--steps", 100, "--setup-s", 1.0, *mode, script=EVAL_SAVE)
    assert run.returncode == 0, run.stderr
    own, summary = measured(run), run.summary()
    goodput = summary["goodput"]
    assert set(goodput) == set(PARTS)
    assert sum(part["share"] for part in goodput.values()) == pytest.approx(1.0, abs=1e-3)
    wall_s = sum(part["seconds"] for part in goodput.values())
    assert wall_s == pytest.approx(own["wall_s"], abs=0.1)  # process start to exit, both
    # 6 evaluations (two after the last step) and 7 saves (one after it): what the script timed.
    assert goodput["evaluation"]["share"] == pytest.approx(own["eval_s"] / own["wall_s"], abs=0.03)
    assert goodput["checkpoint"]["share"] == pytest.approx(own["save_s"] / own["wall_s"], abs=0.03)
    assert goodput["evaluation"]["seconds"] == pytest.approx(own["eval_s"], rel=0.15, abs=0.03)
    assert goodput["checkpoint"]["seconds"] == pytest.approx(own["save_s"], rel=0.15, abs=0.03)
    # The second of setup before the first step is startup, and told apart from the imports.
    startup = summary["startup"]
    assert goodput["startup"]["seconds"] >= 1.0
    assert startup["setup_s"] >= 0.95 and startup["imports_s"] > 0.1 and startup["slowest_import"] == "torch"
    found = kinds(summary)
    evaluations, saves = found["EVAL_HEAVY"]["evidence"], found["CHECKPOINT_STALL"]["evidence"]
    assert evaluations["period_steps"] == 20 and saves["period_steps"] == 15
    # Each counted, those after the last step too: two evaluations there, one save.
    assert (evaluations["count"], saves["count"]) == (own["evaluations"], own["saves"]) == (6, 7)
    assert (evaluations["after_last_step_count"], saves["after_last_step_count"]) == (2, 1)
    assert found["EVAL_HEAVY"]["summary"].startswith("evaluated 6 times (every 20 steps, the last 2 after the last step)")
    # Planned work, told as such: never slow steps (a busy machine's own stalls are told as the
    # machine's, now that no evaluation in a step's time hides them), nor untraced work.
    spikes = found.get("STEP_SPIKES")
    assert spikes is None or (spikes["evidence"]["machine_wide"] and spikes["evidence"]["period_steps"] is None), spikes
    assert "UNTRACED_WORK" not in found
    training = goodput["training"]["share"]
    assert f"Goodput    {training:.0%} · startup" in run.stdout


@pytest.mark.serial  # compares its step times with the script's own (under -n 2, another test beside it)
def test_evaluation_and_saves_between_epochs_are_planned_work_not_slow_steps(traceml_run):
    # run_clm_no_trainer's shape: each epoch ends with an evaluation (torch.no_grad around each
    # batch, the batches fetched with gradients on) and Accelerate's save_state, between one
    # update and the next; the last epoch's come after the last step, then a final save_model.
    run = traceml_run("--epochs", 3, "--steps", 240, "--eval-batches", 10, "--save-mb", 48, script=EVAL_SAVE,
                      timeout=240)
    assert run.returncode == 0, run.stderr
    own, summary = measured(run), run.summary()
    goodput, found = summary["goodput"], kinds(summary)
    # Counted, the ones after the last step too.
    evaluations, saves = found["EVAL_HEAVY"]["evidence"], found["CHECKPOINT_STALL"]["evidence"]
    assert (evaluations["count"], saves["count"]) == (own["evaluations"], own["saves"]) == (3, 4)
    assert (evaluations["after_last_step_count"], saves["after_last_step_count"]) == (1, 2)
    assert found["EVAL_HEAVY"]["summary"].startswith("evaluated 3 times (the last after the last step): ")
    assert found["CHECKPOINT_STALL"]["summary"].startswith("saved a checkpoint 4 times (the last 2 after the last step): ")
    # Timed whole: save_state's gathering and writing, the evaluation's fetches between its regions.
    assert goodput["checkpoint"]["seconds"] == pytest.approx(own["save_s"], rel=0.1)
    assert goodput["evaluation"]["seconds"] == pytest.approx(own["eval_s"], rel=0.1)
    # Never a slow step: the epochs' last steps hold their planned work beside their time, no
    # capture fires for it, and the step figures are the script's own steps' (each from its
    # batch's fetch to its update's end).
    epoch_ends = {row["step"]: row for row in run.step_rows() if row["eval_ms"] > 0}
    assert list(epoch_ends) == [79, 159]
    assert all(row["step_ms"] < row["eval_ms"] / 2 and row["outside_ms"] < row["eval_ms"] / 4
               for row in epoch_ends.values())
    # A capture may fire there on a busy machine's stall, never on the step's planned work.
    for capture in summary["captures"]:
        took_ms = float(re.search(r"took ([\d.]+) ms", capture["detail"]).group(1)) if capture["reason"] == "spike" else 0
        assert capture["step"] not in epoch_ends or took_ms < epoch_ends[capture["step"]]["eval_ms"] / 2, capture
    step = summary["phases"]["step"]
    assert step["mean_ms"] == pytest.approx(own["step_mean_ms"], rel=0.25)
    assert step["p90_ms"] <= 1.25 * own["step_p90_ms"] + 1.0
    assert summary["phases"]["outside"]["mean_ms"] < 0.25 * own["step_mean_ms"]
    spikes = found.get("STEP_SPIKES")
    assert spikes is None or (spikes["evidence"]["machine_wide"] and spikes["evidence"]["period_steps"] is None), spikes


def test_hf_trainer_evaluation_and_checkpoints_match_its_own_figures(traceml_run):
    pytest.importorskip("transformers")
    run = traceml_run("--how", "none", "--max-steps", 40, "--accumulate", 1, "--eval-every", 10,
                      "--save-every", 10, script=HF, timeout=240)
    assert run.returncode == 0, run.stderr
    own, goodput = measured(run), run.summary()["goodput"]
    assert own["evaluations"] == 4 and own["saves"] == 4
    # Trainer's eval_runtime, and the script's clock around Trainer._save_checkpoint.
    assert goodput["evaluation"]["seconds"] == pytest.approx(own["eval_s"], rel=0.2, abs=0.03)
    assert goodput["checkpoint"]["seconds"] == pytest.approx(own["save_s"], rel=0.2, abs=0.03)
    found = kinds(run.summary())
    assert found["EVAL_HEAVY"]["evidence"]["period_steps"] == 10


def sampled_lm_times_s(stdout):
    """What sampled_lm.py timed itself: its sampling, EMA evaluation and EMA updates, in seconds."""
    found = re.search(r"sampling took ([\d.]+) ms, ema evaluation ([\d.]+) ms, ema updates ([\d.]+) ms", stdout)
    return {name: float(value) / 1e3 for name, value in zip(("sample", "ema_eval", "ema_update"), found.groups())}


@pytest.mark.parametrize("mode", [[], ["--trace-step"]], ids=["zero-code", "trace_step"])
def test_sampling_through_an_inner_module_and_an_ema_copys_evaluation_are_evaluation(traceml_run, mode):
    # generate() under no_grad calls the model's inner network, never the traced model, and the
    # EMA copy shares no parameter with it; the EMA's in-place update after each step is no model run.
    run = traceml_run("--out", "out", "--steps", 60, "--sample-every", 10, "--eval-every", 20, *mode,
                      script=SAMPLED, timeout=240)
    assert run.returncode == 0, run.stderr
    own, goodput = sampled_lm_times_s(run.stdout), run.summary()["goodput"]
    evaluation_s = own["sample"] + own["ema_eval"]
    assert goodput["evaluation"]["seconds"] == pytest.approx(evaluation_s, rel=0.2, abs=0.05)
    wall_s = sum(part["seconds"] for part in goodput.values())
    assert goodput["evaluation"]["share"] == pytest.approx(evaluation_s / wall_s, abs=0.02)
    assert goodput["other"]["seconds"] < own["sample"] / 2  # not left between steps as other work
    assert "UNTRACED_WORK" not in kinds(run.summary())


def test_an_ema_update_under_no_grad_is_not_evaluation(traceml_run):
    run = traceml_run("--out", "out", "--steps", 60, "--sample-every", 1000, "--eval-every", 1000,
                      script=SAMPLED, timeout=240)
    assert run.returncode == 0, run.stderr
    own, goodput = sampled_lm_times_s(run.stdout), run.summary()["goodput"]
    assert own["sample"] == own["ema_eval"] == 0 and own["ema_update"] > 0
    assert goodput["evaluation"]["seconds"] == 0


@pytest.mark.serial  # judges which steps stand out; another test beside it made some (under -n 2)
def test_growing_sequence_lengths_are_recompilations_with_their_reason(traceml_run):
    pytest.importorskip("torch._dynamo")
    run = traceml_run("--lengths", "growing", script=COMPILED, timeout=240)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    compiled = summary["compile"]
    # From step 10 a new length every 4 steps: 16 -> 17 ... 23, each a recompilation.
    assert compiled["compilations"] == 1 and compiled["recompilations"] == 7
    assert compiled["first_recompile_step"] == 10
    assert compiled["recompile_reasons"] == [{"reason": "the size of dim 1 of tokens changes", "count": 7}]
    found = kinds(summary)
    finding = found["RECOMPILATION"]
    assert finding["summary"].startswith("7 recompilations after step 4 (first at step 10)")
    assert finding["summary"].endswith("the size of dim 1 of tokens changes")
    assert "mark_dynamic(tokens, 1)" in finding["action"] and "bucket" in finding["action"]
    assert finding["evidence"]["seconds"] == pytest.approx(compiled["recompile_s"], abs=0.01)
    # Compiling is never a spike: the steps that recompiled are told by RECOMPILATION only. On
    # a busy machine the scheduler's slices stall a few of these ~1 ms steps 5-fold: told as the
    # machine's, never at the recompilations' steps or their period.
    spikes = found.get("STEP_SPIKES")
    recompiled = set(range(10, 40, 4))
    assert spikes is None or (spikes["evidence"]["machine_wide"]
                              and spikes["evidence"]["first_spike_step"] not in recompiled
                              and spikes["evidence"]["period_steps"] != 4), spikes


def test_a_graph_break_is_sent_with_its_compilation_when_torchs_metrics_come_late(monkeypatch):
    """On a busy machine the sender's round can come between torch's end callback and its
    metrics: the compilation waits a round, and its graph break must wait with it."""
    import collections
    import time
    from types import SimpleNamespace

    from torch._dynamo import utils as dynamo_utils

    from traceml.probe import compile as compile_watch

    watch = compile_watch.CompileWatch(SimpleNamespace(rank=0))
    metrics = {}
    monkeypatch.setattr(compile_watch, "_compilation_metrics", lambda: metrics)
    monkeypatch.setitem(dynamo_utils.counters, "graph_break", collections.Counter({"a print\nin forward": 1}))
    watch.ended.append(("0/0", "dynamo", 1, 0.0, 250.0, time.monotonic()))
    assert watch.records() == []  # torch has not recorded its metrics yet: next round
    metrics["0/0"] = ("forward (train.py:12)", "")
    (record,) = watch.records()
    assert (record.code, record.graph_breaks, record.graph_break_reasons) == ("forward (train.py:12)", 1, ["a print"])


def test_fixed_lengths_compile_once_and_a_graph_break_is_counted(traceml_run):
    pytest.importorskip("torch._dynamo")
    # With --deep: per-layer hooks inside compiled graphs would break them and recompile them
    # every sampled step, so deep-dive pauses once torch has compiled, and says so.
    run = traceml_run("--lengths", "fixed", "--graph-break", script=COMPILED, timeout=240,
                      traceml_args=("--deep",))
    assert run.returncode == 0, run.stderr
    assert "traceml: deep-dive paused: torch.compile compiled the model" in run.stderr
    assert "recompile" not in run.stderr.replace("make it recompile", "")  # no torch warning
    summary = run.summary()
    compiled = summary["compile"]
    assert compiled["recompilations"] == 0 and "RECOMPILATION" not in kinds(summary)
    # The graph break splits forward in two frames, each compiled once, before step 1.
    assert compiled["compilations"] == 2 and compiled["graph_breaks"] == 1
    assert compiled["graph_break_reasons"] == ["Call to `torch._dynamo.graph_break()`"]
    assert summary["startup"]["first_compilation_s"] > 0.05
    card = re.sub(r"[\s│]+", " ", run.stdout)  # the card's lines joined
    assert "Compile 2 compilations, 0 recompilations · " in card
    assert " · 1 graph break: Call to `torch._dynamo.graph_break()`" in card


# -- the rules, on made-up figures ----------------------------------------------------------------

def hello(rank=0, started=1000.0, imports_ms=None):
    return RankHello(rank=rank, local_rank=rank, world_size=1, node_rank=0, host="h", pid=1, device="cpu",
                     device_name="cpu", device_capacity_bytes=None, torch_version="2", argv=["t.py"],
                     started_at_unix_s=started, imports_ms=imports_ms, slowest_import="transformers")


def step(index, start, step_ms=100.0, outside_ms=0.0, eval_ms=0.0, checkpoint_ms=0.0, input_wait_ms=0.0):
    return StepRecord(rank=0, step=index, start_unix_s=start, step_ms=step_ms, input_wait_ms=input_wait_ms,
                      outside_ms=outside_ms, h2d_ms=0.0, forward_ms=step_ms - outside_ms - input_wait_ms,
                      backward_ms=0.0, optimizer_ms=0.0, untraced_ms=0.0, gc_ms=0.0, gc_collections=0,
                      forward_calls=1, samples=1, eval_ms=eval_ms, checkpoint_ms=checkpoint_ms)


def test_the_parts_add_up_to_the_wall_time_and_put_each_second_in_its_place():
    # Start at 1000 s; first step at 1010 (10 s startup, 2 of them imports); 10 steps of 100 ms, one
    # of them with 300 ms of evaluation and 200 ms of a save between steps, one with a save of
    # 50 ms inside it (beside step_ms, as the probe records them); then 1 s of two final
    # evaluations and 0.5 s of teardown.
    records = [hello(imports_ms=2000.0), step(0, 1010.0, input_wait_ms=40.0)]
    start = 1010.1
    for index in range(1, 10):
        if index == 4:
            records.append(step(index, start, step_ms=100.0, outside_ms=20.0, eval_ms=300.0, checkpoint_ms=200.0))
            start += 0.6
        elif index == 6:
            records.append(step(index, start, step_ms=50.0, checkpoint_ms=50.0))
            start += 0.1
        else:
            records.append(step(index, start))
            start += 0.1
    records.append(RankEnd(rank=0, exit_code=0, records_sent=0, records_dropped=0,
                           ended_unix_s=start + 1.5, tail_eval_ms=1000.0, tail_evaluations=2))
    goodput = RunTime.of(records).goodput(now_unix_s=None)
    seconds = {part: goodput.seconds(part) for part in PARTS}
    assert sum(seconds.values()) == pytest.approx(start + 1.5 - 1000.0)
    assert seconds["startup"] == pytest.approx(10.0 + 0.04)  # the first batch's wait included
    assert seconds["evaluation"] == pytest.approx(1.3)
    assert seconds["checkpoint"] == pytest.approx(0.25)
    # 1.5 s of steps less planned work, the first batch and 20 ms of other work between steps.
    assert seconds["training"] == pytest.approx(1.5 - 0.3 - 0.25 - 0.04 - 0.02)
    assert seconds["other"] == pytest.approx(0.02 + 0.5)
    assert goodput.after_last_step == {"evaluation": {"ms": 1000.0, "count": 2}, "checkpoint": {"ms": 0.0, "count": 0}}
    assert goodput.startup["imports_s"] == pytest.approx(2.0)
    assert goodput.startup["setup_s"] == pytest.approx(10.04 - 2.0 - 0.04)


def goodput_of(startup_s, wall_s, imports_ms=None):
    records = [hello(imports_ms=imports_ms), step(0, 1000.0 + startup_s, step_ms=(wall_s - startup_s) * 1e3)]
    return RunTime.of(records).goodput(now_unix_s=1000.0 + wall_s)


def test_slow_startup_at_its_lines_and_naming_its_largest_part():
    assert slow_startup(goodput_of(startup_s=30.0, wall_s=STARTUP_MIN_RUN_S - 1)) is None  # a short run
    assert slow_startup(goodput_of(startup_s=19.0, wall_s=100.0)) is None  # 19% of the run
    found = slow_startup(goodput_of(startup_s=25.0, wall_s=100.0, imports_ms=18000.0))
    assert found.severity == "warn" and found.evidence["largest_part"] == "imports"
    assert found.summary.startswith("startup takes 25.0 s, 25% of the 100.0 s run, before the first step: "
                                    "the script's imports 18.0 s (transformers the slowest)")
    assert "importtime" in found.action
    crit = slow_startup(goodput_of(startup_s=50.0, wall_s=100.0, imports_ms=1000.0))
    assert crit.severity == "crit" and crit.evidence["largest_part"] == "setup"


@pytest.mark.parametrize("raw, words", [
    ("0/3: tensor 'args[0]' size mismatch at index 1. expected 11, actual 12", "the size of dim 1 of input 0 changes"),
    ("1/1: tensor 'x' dtype mismatch. expected Float, actual Half", "the dtype of x changes"),
    ("0/1: L['n'] == 3", "the Python value n changes"),
    ("0/1: GLOBAL_STATE changed: grad_mode ", "the gradient mode changes (called in training and under no_grad)"),
])
def test_torch_guard_failures_in_a_users_words(raw, words):
    assert plain_reason(raw)[0] == words


def compile_record(step_index, attempt, duration_ms=500.0):
    return CompileRecord(rank=0, step=step_index, start_unix_s=0.0, duration_ms=duration_ms,
                         compile_id=f"0/{attempt}", trigger="dynamo",
                         recompile_reason="" if attempt == 0 else
                         f"0/{attempt - 1}: tensor 'args[0]' size mismatch at index 1. expected 8, actual 9")


def test_recompilation_lines_count_and_share():
    first = [compile_record(0, 0)]
    few = first + [compile_record(20 + i, 1 + i, duration_ms=100.0) for i in range(3)]
    assert recompilations(few, after_step=5, run_ms=100_000.0) is None  # 3, 0.3% of the run
    many = first + [compile_record(20 + i, 1 + i, duration_ms=100.0) for i in range(4)]
    assert recompilations(many, after_step=5, run_ms=100_000.0).evidence["recompilations"] == 4
    costly = first + [compile_record(20, 1, duration_ms=6000.0)]
    assert recompilations(costly, after_step=5, run_ms=100_000.0).evidence["share"] == 0.06
    early = first + [compile_record(2 + i, 1 + i) for i in range(5)]  # all within warm-up
    assert recompilations(early, after_step=5, run_ms=100_000.0) is None
