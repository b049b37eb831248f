"""The object API without trace_step: steps inferred from optimizer.step(), real loops."""
import json
import sqlite3
import statistics

import pytest
from conftest import SCRIPTS

from traceml.views.summary import card_text

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


def test_spans_reach_the_summary_the_card_and_the_report(traceml_run, tmp_path):
    # A 4 ms sleep in a span "nap" every third step (steps 0, 3, ..., 57), "compute" in every
    # step: their figures, over the steps after warm-up, against the store's rows summed here
    # and against the script's own perf_counter around each sleep.
    truth_file = tmp_path / "truth.json"
    run = traceml_run("--steps", 60, "--nap-ms", 4, "--nap-every", 3, "--truth", truth_file, script=API_LOOP)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    first = summary["steps"]["warmup_excluded"]
    assert summary["steps"]["count"] == 60 and first == 5
    with sqlite3.connect(run.run_dir / "telemetry.sqlite") as db:
        nap_rows = [ms for ms, in db.execute("SELECT duration_ms FROM spans WHERE name = 'nap' AND step >= ?",
                                             (first,))]
        steps, step_total_ms = db.execute("SELECT COUNT(*), SUM(step_ms) FROM steps WHERE step >= ?",
                                          (first,)).fetchone()
    script_ms = {int(step): ms for step, ms in json.loads(truth_file.read_text())["nap_ms"].items()
                 if int(step) >= first}
    assert sorted(script_ms) == list(range(6, 60, 3)) and len(nap_rows) == 18 and steps == 55

    nap = summary["spans"]["nap"]
    assert (nap["count"], nap["steps"]) == (18, 18)
    assert nap["median_ms"] == pytest.approx(statistics.median(nap_rows), abs=1e-3)
    assert nap["total_ms_per_step"] == pytest.approx(sum(nap_rows) / 55, abs=1e-3)
    assert nap["share"] == pytest.approx(sum(nap_rows) / step_total_ms, abs=1e-3)
    # The span's clock encloses the script's: a little more, by µs (margins for a busy machine).
    assert statistics.median(script_ms.values()) <= nap["median_ms"] <= statistics.median(script_ms.values()) + 1.0
    assert sum(script_ms.values()) <= sum(nap_rows) <= 1.1 * sum(script_ms.values()) + 5.0
    assert nap["median_ms"] >= 4.0 and 0.0 < nap["share"] < 1.0
    compute = summary["spans"]["compute"]
    assert (compute["count"], compute["steps"]) == (55, 55)  # one call in each measured step
    per_step = [span["total_ms_per_step"] for span in summary["spans"].values()]
    assert len(per_step) == 2 and per_step == sorted(per_step, reverse=True)  # the most time first

    card = (run.run_dir / "final_summary.txt").read_text()
    rows = {line.strip("│ ").split()[0]: line.strip("│ ").split() for line in card.splitlines()
            if line.strip("│ ").split()[:1] in (["nap"], ["compute"])}
    assert "user spans (overlap the phases)" in card
    assert rows["nap"] == ["nap", "18", "18", f"{nap['median_ms']:.2f}", f"{nap['total_ms_per_step']:.2f}",
                           f"{nap['share']:.1%}"]
    assert rows["compute"][1:3] == ["55", "55"]
    # The block (title, header, rule, two rows, caption: 8 lines) is all the spans add: without
    # it the card is the one a run without spans gets.
    lines = card.splitlines()
    at = next(index for index, line in enumerate(lines) if "user spans" in line)
    assert "median: a step it ran in" in lines[at + 7]
    assert lines[:at] + lines[at + 8:] == card_text({**summary, "spans": {}}).splitlines()

    report = (run.run_dir / "report.html").read_text()
    assert (f"<tr><td>nap</td><td>18</td><td>18</td><td>{nap['median_ms']:.2f}</td>"
            f"<td>{nap['total_ms_per_step']:.2f}</td><td>{nap['share']:.1%}</td></tr>") in report
