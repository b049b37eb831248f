"""Trainer integrations and zero-code mode on real, tiny, offline training runs: Hugging Face
Trainer (a GPT-2 built from a config), Lightning (both namespaces), Accelerate, and a script
that never imports traceml. Trainer's and Lightning's runs are made beside the same script
without TraceML, and must save the same model (test_field's check)."""
import importlib.util
import sqlite3
import sys

import pytest

from conftest import SCRIPTS
from test_field import assert_invisible, side_by_side, traceml_run as field_command

# Found, not imported: the runs import it, and importing it here costs each pytest worker a second.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
HF = SCRIPTS / "hf_trainer.py"
LIGHTNING = SCRIPTS / "lightning_fit.py"


def steps_of(run):
    with sqlite3.connect(run.run_dir / "telemetry.sqlite") as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM steps ORDER BY step")]


# The Trainer run with TraceML's callback, made once (one worker: --dist loadgroup) for the
# tests that read it, beside the same script without TraceML, whose saved model it must match.
hf_callback = pytest.mark.xdist_group("hf_callback")
HF_CALLBACK_ARGS = ["--max-steps", "30", "--accumulate", "4", "--collate-ms", "20", "--eval-every", "10",
                    "--eval-rows", "128", "--save", "saved"]


@pytest.fixture(scope="module")
def hf_callback_runs(tmp_path_factory):
    """Trainer without TraceML and with its callback, side by side: 30 updates of 4 micro-batches
    of 4, each batch's collate sleeping 20 ms, an evaluation of 128 rows (32 batches) after
    every 10th update, and the model saved at the end. (plain process, traced Run)"""
    where = tmp_path_factory.mktemp("hf_callback")
    return side_by_side(where, [sys.executable, str(HF), "--how", "none", *HF_CALLBACK_ARGS],
                        field_command(HF, "--how", "callback", *HF_CALLBACK_ARGS))


@pytest.fixture(scope="module")
def hf_callback_run(hf_callback_runs):
    return hf_callback_runs[1]


@hf_callback
def test_hf_trainer_saves_the_same_model_as_without_traceml(hf_callback_runs):
    plain, traced = hf_callback_runs
    folder = traced.run_dir.parent.parent
    assert_invisible(plain, traced, folder / "plain" / "saved", folder / "traced" / "saved")


@hf_callback
def test_hf_trainer_makes_one_step_per_update_and_sees_a_slow_collate(hf_callback_run):
    run = hf_callback_run
    assert run.returncode == 0, run.stderr
    assert "trained 30 updates" in run.stdout
    steps = steps_of(run)
    assert len(steps) == 30
    assert all(s["forward_calls"] == 4 and s["samples"] == 16 for s in steps)  # 4 micro-batches of 4
    assert all(s["forward_ms"] > 0 and s["backward_ms"] > 0 and s["optimizer_ms"] > 0 for s in steps)
    # The four collates of an update (4 x 20 ms) are fetched before its first forward, and
    # count for that update.
    assert all(s["input_wait_ms"] >= 78.0 for s in steps[1:])
    summary = run.summary()
    # On a loaded machine the imports alone can take most of a run past a minute: then its
    # start is the larger cost, and the slow collate is the next finding.
    kinds = [finding["kind"] for finding in summary["findings"]]
    primary = summary["primary_diagnosis"]["kind"]
    assert primary == "INPUT_BOUND" or (primary == "SLOW_STARTUP" and "INPUT_BOUND" in kinds), kinds
    assert summary["steps"]["found_by"].startswith("Hugging Face Trainer")
    assert "found by Hugging Face Trainer" in run.stdout


@hf_callback
def test_hf_evaluation_is_outside_the_steps_not_input_wait(hf_callback_run):
    run = hf_callback_run
    assert run.returncode == 0, run.stderr
    steps = steps_of(run)
    assert len(steps) == 30
    # After update 10 Trainer evaluates 32 batches at 20 ms a collate: that is evaluation beside
    # step 9 (planned work, never the step's time), and none of it is the training's input wait.
    assert steps[9]["eval_ms"] >= 600.0 and steps[9]["outside_ms"] < 100.0
    # Misread as input wait, it would land in the step after: that step waits as the others do.
    usual_wait_ms = sorted(s["input_wait_ms"] for s in steps)[len(steps) // 2]
    assert steps[10]["input_wait_ms"] < max(3 * usual_wait_ms, 0.25 * steps[9]["eval_ms"])
    assert run.summary()["goodput"]["evaluation"]["seconds"] >= 0.6


@pytest.mark.parametrize("how", ["seed", "trainer"])
def test_seed_snippets_run_unchanged(plain_run, how):
    # `from traceml_ai.integrations import huggingface as traceml_hf; traceml_hf.init();
    # Trainer(..., callbacks=[traceml_hf.TraceMLTrainerCallback()])`, and
    # `traceml.hf_decorators.TraceMLTrainer(...)`, under plain python.
    run = plain_run("--how", how, "--max-steps", 8, "--accumulate", 2, script=HF, timeout=240)
    assert run.returncode == 0, run.stderr
    steps = steps_of(run)
    assert len(steps) == 8 and all(s["forward_calls"] == 2 for s in steps)
    assert run.summary()["steps"]["found_by"].startswith("Hugging Face Trainer")


@pytest.mark.parametrize("namespace, accumulate", [("lightning", 1), ("pytorch_lightning", 2)])
def test_lightning_fit_steps_are_optimizer_steps_and_validation_is_not_input(traceml_run, tmp_path, namespace,
                                                                              accumulate):
    """The first beside the same fit without TraceML's callback, whose saved model it must match."""
    pytest.importorskip(namespace)
    args = ["--namespace", namespace, "--steps", "80", "--accumulate", str(accumulate), "--save", "saved/model.pt"]
    if namespace == "lightning":
        plain, run = side_by_side(tmp_path, [sys.executable, str(LIGHTNING), "--untraced", *args],
                                  field_command(LIGHTNING, *args))
        assert_invisible(plain, run, tmp_path / "plain" / "saved", tmp_path / "traced" / "saved")
    else:
        run = traceml_run(*args, script=LIGHTNING, timeout=240)
    assert run.returncode == 0, run.stderr
    assert "fit 80 optimizer steps" in run.stdout
    steps = steps_of(run)
    assert len(steps) == 80
    assert all(s["forward_calls"] == accumulate for s in steps)
    assert all(s["forward_ms"] > 0 and s["backward_ms"] > 0 and s["optimizer_ms"] > 0 for s in steps)
    # Validation reads 4 batches of 8 slow samples (2 ms each: 64 ms) every 20 training
    # batches: evaluation beside the steps, never the training's input wait. (The training's own
    # batches are quick, but a loaded machine held one step's fetch 40.5 ms: the line is what a
    # whole validation would add.)
    assert max(s["input_wait_ms"] for s in steps) < 64.0
    validated = [s for s in steps if s["eval_ms"] >= 50.0]
    assert 2 <= len(validated) <= 80 // (20 // accumulate) + 1
    assert all(s["input_wait_ms"] < s["eval_ms"] for s in validated)
    summary = run.summary()
    assert summary["steps"]["found_by"].startswith("Lightning")
    # Each validation, timed whole, is evaluation in goodput: at least its 64 ms of loading.
    assert summary["goodput"]["evaluation"]["seconds"] >= 0.064 * len(validated)


def test_zero_code_traces_a_script_that_never_imports_traceml(traceml_run):
    run = traceml_run("--steps", 40, "--collate-ms", 5, script=SCRIPTS / "untouched_loop.py")
    assert run.returncode == 0, run.stderr
    assert "trained 40 steps" in run.stdout
    summary = run.summary()
    assert summary["steps"]["count"] == 40  # the no_grad look at the model is not a step
    assert summary["steps"]["found_by"] == "optimizer.step() (inferred)"
    assert "found by optimizer.step() (inferred)" in run.stdout
    assert summary["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    steps = steps_of(run)
    assert all(s["forward_calls"] == 1 and s["samples"] == 16 for s in steps)  # MSELoss is not the model
    assert all(s["backward_ms"] > 0 and s["optimizer_ms"] > 0 for s in steps)


@pytest.mark.parametrize("untraced", [False, True])
def test_accelerate_loops_are_traced(traceml_run, untraced):
    pytest.importorskip("accelerate")
    run = traceml_run("--steps", 30, "--load-ms", 1, *(["--untraced"] if untraced else []),
                      script=SCRIPTS / "accelerate_loop.py", timeout=240)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["steps"]["count"] == 30
    assert summary["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    assert summary["steps"]["found_by"] == ("optimizer.step() (inferred)" if untraced else "trace_step")
    steps = steps_of(run)
    assert all(s["forward_ms"] > 0 and s["backward_ms"] > 0 and s["optimizer_ms"] > 0 for s in steps)
