"""Every untimed second has a name: the code the training thread was sampled in, inside the step
outside its timed phases, between steps and at startup (probe/code_sites.py, diagnose/untimed.py)."""
import json
import sqlite3
import sys

import pytest
from conftest import SCRIPTS, ended_well, wide_mlp

from traceml.probe import code_sites
from traceml.probe.code_sites import RECENT_STEPS_MS, SAMPLE_LINE, CodeSampler
from traceml.records import MAX_WARMUP_STEPS, StepRecord

UNTIMED_LOOP = SCRIPTS / "untimed_loop.py"


def step(untraced_ms=0.0, outside_ms=0.0, step_ms=100.0, index=10):
    return StepRecord(rank=0, step=index, start_unix_s=0.0, step_ms=step_ms, input_wait_ms=0.0, outside_ms=outside_ms,
                      h2d_ms=0.0, forward_ms=step_ms - untraced_ms - outside_ms, backward_ms=0.0, optimizer_ms=0.0,
                      untraced_ms=untraced_ms, gc_ms=0.0, gc_collections=0, forward_calls=1, samples=8)


class Probe:
    in_step, open_phase, in_evaluation = 1, -1, False


def test_a_clean_loop_never_reads_a_stack(monkeypatch):
    def no_stack():
        raise AssertionError("a clean loop's stack was read")

    sampler = CodeSampler(thread_id=0)
    monkeypatch.setattr(code_sites.sys, "_current_frames", no_stack)
    probe = Probe()
    # The first step sets the probe up (untraced), then 5 s of steps with 5% untraced and 5%
    # between steps: under the line.
    sampler.note_steps([step(untraced_ms=900.0, step_ms=1000.0, index=0)])
    for _ in range(50):
        sampler.note_steps([step(untraced_ms=5.0, outside_ms=5.0)])
        for in_step in (0, 1):
            probe.in_step = in_step
            sampler.sample(probe)
    assert not sampler.untraced_on and not sampler.outside_on
    assert sampler.records(rank=0) == []


def test_a_large_untraced_share_samples_only_outside_the_timed_phases():
    import threading

    sampler = CodeSampler(thread_id=threading.get_ident())
    sampler.note_steps([step(untraced_ms=60.0)] * 10)
    assert sampler.untraced_on and not sampler.outside_on
    probe = Probe()
    probe.open_phase = 1  # forward: timed, not sampled
    sampler.sample(probe)
    probe.open_phase, probe.in_step = -1, 0  # between steps: small, not sampled
    sampler.sample(probe)
    assert sampler.records(rank=0) == []
    probe.in_step = 1
    line = sys._getframe().f_lineno + 1
    sampler.sample(probe)  # this very function is the user's code sampled
    (record,) = sampler.records(rank=0)
    assert record.part == "untraced" and record.samples == 1 and record.seconds > 0
    (site,) = record.sites
    assert (site.function, site.line, site.file) == (
        "test_a_large_untraced_share_samples_only_outside_the_timed_phases", line, __file__)
    sampler.note_steps([step(untraced_ms=1.0)] * 10)  # the share fell: sampling stops
    assert not sampler.untraced_on


def _timings(run):
    return json.loads((run.run_dir.parent / "timings.json").read_text())


def own_share(timings, part, summary):
    """The script's own share of its steps in `part` ("helper_s", "between_s"), over the steps
    TraceML measured (the warm-up left out)."""
    first, starts = summary["steps"]["warmup_excluded"], timings["starts"]
    return sum(timings[part][first:]) / (starts[-1] - starts[first])


def close_to(evidence, own, run_dir, part):
    """The named share is its part's measured share times a fraction of the part's samples: within
    three of that fraction's standard errors of the script's own figure, and 2 points besides.
    The fraction's error is Agresti and Coull's (two hits and two misses added): when every
    sample lands in one function, the fraction reads 1 but is not known to be exactly 1."""
    with sqlite3.connect(f"file:{run_dir / 'telemetry.sqlite'}?mode=ro", uri=True) as db:
        (sample,) = db.execute("SELECT sample FROM code_sites WHERE part = ?", (part,)).fetchone()
    samples = json.loads(sample)[3]
    fraction = min(1.0, evidence["code_1_share"] / evidence[f"{part}_share"])
    adjusted = (fraction * samples + 2) / (samples + 4)
    error = 3 * (adjusted * (1 - adjusted) / (samples + 4)) ** 0.5 * evidence[f"{part}_share"] + 0.02
    return abs(evidence["code_1_share"] - own) <= error


def _code_rows(run_dir):
    with sqlite3.connect(f"file:{run_dir / 'telemetry.sqlite'}?mode=ro", uri=True) as db:
        return dict(db.execute("SELECT part, COUNT(*) FROM code_sites GROUP BY part").fetchall())


def test_a_helper_after_the_update_and_a_slow_start_are_named(traceml_run, tmp_path):
    # 30 ms of metrics after optimizer.step() inside each step; at startup, a walk of a registry
    # that imports 300 modules on one top-level line, then a second of building.
    run = traceml_run("--steps", 100, "--helper-ms", 30, "--modules", 300, "--build-ms", 1000,
                      "--timings", tmp_path / "timings.json", script=UNTIMED_LOOP)
    assert ended_well(run), run.stderr
    timings, summary = _timings(run), run.summary()
    lines = timings["lines"]
    primary = summary["primary_diagnosis"]
    assert primary["kind"] == "UNTRACED_WORK"
    evidence = primary["evidence"]
    assert evidence["code_1"] == f"untimed_loop.py:{lines['update_metrics']} update_metrics"
    assert close_to(evidence, own_share(timings, "helper_s", summary), run.run_dir, "untraced"), (evidence, timings)
    assert f"{evidence['code_1_share']:.0%} of the step in {evidence['code_1']}" in primary["summary"]
    assert summary["code"]["untraced"]["sites"][0]["where"] == evidence["code_1"]
    card = (run.run_dir / "final_summary.txt").read_text()
    assert "Untimed" in card and f"untimed_loop.py:{lines['update_metrics']}" in card
    # Startup: the walk's module loads count as imports, wherever the script made them.
    startup = summary["startup"]
    assert startup["modules_imported"] >= 300
    assert startup["imports_s"] >= 0.8 * timings["walk_s"]
    assert startup["setup_s"] >= 0.8 * timings["build_s"]
    sites = {site["where"]: site for site in summary["code"]["startup"]["sites"]}
    walk = sites[f"untimed_loop.py:{lines['walk']} (module level)"]
    assert walk["importing_s"] >= 0.8 * walk["seconds"] > 0
    build = sites[f"untimed_loop.py:{lines['build']} build"]
    assert abs(build["seconds"] - timings["build_s"]) <= 0.3 * timings["build_s"] + 0.2, (build, timings)
    assert build["importing_s"] < 0.1 * build["seconds"]
    assert _code_rows(run.run_dir).keys() == {"untraced", "startup"}  # nothing large between steps


def test_work_between_steps_is_named_and_alerted(traceml_run, tmp_path):
    alerts = tmp_path / "alerts.jsonl"
    # The loop goes on past its 100 steps until the alert is written: a loaded machine's live
    # findings come later than a quiet one's.
    run = traceml_run("--steps", 100, "--between-ms", 30, "--timings", tmp_path / "timings.json",
                      "--until", alerts, script=UNTIMED_LOOP, traceml_args=("--on-alert", f"cat >> {alerts}"))
    assert ended_well(run), run.stderr
    timings, summary = _timings(run), run.summary()
    primary = summary["primary_diagnosis"]
    assert primary["kind"] == "UNTRACED_WORK"
    evidence = primary["evidence"]
    assert evidence["code_1"] == f"untimed_loop.py:{timings['lines']['log_everything']} log_everything"
    assert close_to(evidence, own_share(timings, "between_s", summary), run.run_dir, "outside"), (evidence, timings)
    documents = [json.loads(line) for line in alerts.read_text().splitlines()]
    (alert,) = [document for document in documents if document["kind"] == "UNTRACED_WORK"]
    assert alert["evidence"]["code_1"] == evidence["code_1"] and evidence["code_1"] in alert["summary"]


@wide_mlp
def test_a_compute_bound_run_samples_no_step(wide_mlp_run):
    assert ended_well(wide_mlp_run)
    sampled = {"untraced", "outside"} & _code_rows(wide_mlp_run.run_dir).keys()
    # A part is sampled only where the run's own steps had it at SAMPLE_LINE of a stretch of
    # RECENT_STEPS_MS (on a busy machine, other processes' time slices between steps can be).
    rows = [row for row in wide_mlp_run.step_rows() if row["step"] >= MAX_WARMUP_STEPS]
    for part in sampled:
        stretches, step_ms, part_ms = [], 0.0, 0.0
        for row in rows:
            step_ms, part_ms = step_ms + row["step_ms"], part_ms + row[f"{part}_ms"]
            if step_ms >= RECENT_STEPS_MS:
                stretches.append(part_ms / step_ms)
                step_ms = part_ms = 0.0
        assert max(stretches, default=0.0) >= SAMPLE_LINE, (part, stretches)
    assert "untraced" not in wide_mlp_run.summary()["code"]


def test_slow_startup_names_the_line_and_the_modules_imported():
    from traceml.analysis.goodput import RunTime
    from traceml.diagnose.run_time import slow_startup
    from traceml.records import CodeSample, CodeSite, RankHello

    # The case: 21.5 s of startup, 19 of them imports, 16.8 s in one top-level line.
    hello = RankHello(rank=0, local_rank=0, world_size=1, node_rank=0, host="h", pid=1, device="cpu",
                      device_name="cpu", device_capacity_bytes=None, torch_version="2", argv=["run_clm.py"],
                      started_at_unix_s=1000.0, imports_ms=19000.0, slowest_import="transformers",
                      modules_imported=1012)
    first = step(step_ms=80_000.0)
    first.start_unix_s = 1021.5
    goodput = RunTime.of([hello, first]).goodput(now_unix_s=1101.5)
    sites = [CodeSite(file="/x/run_clm.py", line=57, function="<module>", seconds=16.8, importing_s=16.7),
             CodeSite(file="/x/run_clm.py", line=410, function="main", seconds=2.1, statement=700)]
    code = [CodeSample(rank=0, part="startup", samples=1000, seconds=21.0, sites=sites)]
    found = slow_startup(goodput, code)
    assert found.summary.endswith("; 16.8 s in run_clm.py:57 (module level), 2.1 s in run_clm.py:410 main, "
                                  "1,012 modules imported")
    evidence = found.evidence
    assert (evidence["code_1"], evidence["code_1_s"], evidence["modules_imported"]) == (
        "run_clm.py:57 (module level)", 16.8, 1012)
    assert (evidence["code_2"], evidence["code_2_s"]) == ("run_clm.py:410 main", 2.1)
    assert evidence["imports_s"] == 19.0 and evidence["setup_s"] == 2.5


def test_the_import_timer_counts_every_module_load_wherever_it_is_made(tmp_path, monkeypatch):
    import importlib

    from traceml.probe import zero_code

    (tmp_path / "walked_pkg").mkdir()
    (tmp_path / "walked_pkg" / "__init__.py").write_text("")
    (tmp_path / "walked_pkg" / "slow.py").write_text("import time\ntime.sleep(0.05)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bootstrap = zero_code._bootstrap
    timer = bootstrap._find_and_load = zero_code._ImportTimer(bootstrap._find_and_load)
    try:
        importlib.import_module("walked_pkg.slow")  # not an import statement: a registry's walk
    finally:
        figures = timer.stop()
    assert bootstrap._find_and_load is timer.original
    assert figures["imports_ms"] >= 50 and figures["slowest_import"] == "walked_pkg"
    for name in ("walked_pkg.slow", "walked_pkg"):
        sys.modules.pop(name)
