"""The object API without trace_step: steps inferred from optimizer.step(), real loops."""
import sqlite3

from conftest import SCRIPTS

API_LOOP = SCRIPTS / "trace_api_loop.py"


def step_figures(run):
    with sqlite3.connect(run.run_dir / "telemetry.sqlite") as db:
        return db.execute("SELECT COUNT(*), MIN(forward_calls), MAX(forward_calls), MIN(samples), "
                          "MAX(samples), MIN(forward_ms), MIN(backward_ms), MIN(optimizer_ms) "
                          "FROM steps").fetchone()


def test_gradient_accumulation_makes_one_step_per_update(plain_run):
    run = plain_run("--steps", 30, "--accumulate", 4, script=API_LOOP)
    assert run.returncode == 0, run.stderr
    assert run.run_dir.name.endswith("-api_loop")  # named after tracer.trace("api_loop")
    count, min_calls, max_calls, min_samples, max_samples, forward, backward, optimizer = step_figures(run)
    assert count == 30
    assert min_calls == max_calls == 4  # four micro-batch forwards in each step
    assert min_samples == max_samples == 32  # four batches of eight
    assert forward > 0 and backward > 0 and optimizer > 0


def test_a_slow_loader_is_input_bound_with_inferred_steps(traceml_run):
    run = traceml_run("--steps", 40, "--load-ms", 2, script=API_LOOP)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["steps"]["count"] == 40
    assert summary["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    assert summary["phases"]["input_wait"]["median_ms"] >= 14.0  # 8 samples x 2 ms, at least
    # The loss module has no parameters: only the model's call counts as forward.
    assert step_figures(run)[1:3] == (1, 1)


def test_an_explicit_trace_step_decides_the_steps(plain_run):
    run = plain_run("--steps", 25, "--accumulate", 2, "--explicit", script=API_LOOP)
    assert run.returncode == 0, run.stderr
    count, min_calls, max_calls, *_ = step_figures(run)
    assert count == 25 and min_calls == max_calls == 2
    with sqlite3.connect(run.run_dir / "telemetry.sqlite") as db:
        spans = db.execute("SELECT COUNT(*), SUM(count) FROM spans WHERE name = 'compute'").fetchone()
    assert spans == (25, 50)


def test_a_second_traced_region_records_its_steps_as_the_first_did(plain_run):
    # Pretraining then fine-tuning in one process, each region with a new optimizer: the
    # second region must find the model and its optimizer again after the first one's detach.
    run = plain_run("--steps", 12, "--regions", 2, script=API_LOOP)
    assert run.returncode == 0, run.stderr
    assert run.run_dir.name.endswith("-api_loop")  # one run, named after the first region
    with sqlite3.connect(run.run_dir / "telemetry.sqlite") as db:
        steps = db.execute("SELECT step, forward_calls, samples, forward_ms, optimizer_ms FROM steps "
                           "ORDER BY step").fetchall()
        scalar_steps = db.execute("SELECT COUNT(DISTINCT step) FROM scalars WHERE name = 'loss'").fetchone()[0]
        span_steps = db.execute("SELECT COUNT(DISTINCT step) FROM spans WHERE name = 'compute'").fetchone()[0]
    assert [row[0] for row in steps] == list(range(24))
    assert {row[1:3] for row in steps} == {(1, 8)}  # one model call of 8 samples in every step
    assert all(forward > 0 and optimizer > 0 for *_, forward, optimizer in steps)
    assert scalar_steps == span_steps == 24
