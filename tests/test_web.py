"""The web dashboard against real servers: a finished run served in-process, `traceml run
--mode dashboard` and `traceml view` as subprocesses, the seed API script, and a real browser."""
import base64
import json
import os
import re
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from traceml.collector.store import Store
from traceml.records import (STEP_PHASES, GpuSample, MemoryLedger, RankHello, ScalarRecord, StepRecord,
                             SystemSample)
from traceml.report import queries
from traceml.report.queries import MAX_POINTS
from traceml.report.run_source import RunSource
from traceml.views.web.app import WebServer, worded_memory

from conftest import SCRIPTS, TRAIN_LOOP, _env

# One worker for the module: its finished run and server are made once (conftest.py).
pytestmark = pytest.mark.xdist_group("web")

ROOT = Path(__file__).parent.parent
API_LOOP = SCRIPTS / "trace_api_loop.py"
SEED = ROOT / "examples" / "seed_api.py"
ARTIFACTS = Path(os.environ.get("TRACEML_ARTIFACTS", ROOT / "test-artifacts"))
URL_LINE = re.compile(r"dashboard at (http://127\.0\.0\.1:\d+/)")


def stop(process):
    """End a `traceml run` a test left running (it failed): SIGTERM, as a user's Ctrl-C, lets it
    stop its script too; SIGKILL would leave the script running without it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def get(base, path, expect=200):
    try:
        with urllib.request.urlopen(base.rstrip("/") + path, timeout=10) as response:
            status, body, kind = response.status, response.read(), response.headers.get("content-type", "")
    except urllib.error.HTTPError as error:
        status, body, kind = error.code, error.read(), error.headers.get("content-type", "")
    assert status == expect, (path, status, body[:200])
    return json.loads(body) if "json" in kind else body


def read_url(process, timeout_s=60.0):
    """The dashboard URL from a process's stderr; the lines read on the way are returned too."""
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        match = URL_LINE.search(line)
        if match:
            return match.group(1), lines
    raise AssertionError(f"no dashboard URL in: {''.join(lines)}")


# -- a finished run, served in-process ---------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The Trace API loop under `traceml run --deep`: spans, scalars and layers all present."""
    tmp = tmp_path_factory.mktemp("web")
    run_dir = tmp / "run"
    process = subprocess.run(
        [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--deep", "--run-dir",
         str(run_dir), str(API_LOOP), "--steps", "60", "--accumulate", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp, env=_env())
    assert process.returncode == 0, process.stderr
    return run_dir


@pytest.fixture(scope="module")
def served(finished_run):
    web = WebServer(RunSource.of_finished_run(finished_run), "127.0.0.1", 0)
    web.start()
    yield web.url, finished_run
    web.stop()


def test_overview_of_a_finished_run_is_its_summary(served):
    base, run_dir = served
    summary = json.loads((run_dir / "final_summary.json").read_text())
    overview = get(base, "/api/overview")
    assert overview["live"] is False
    assert overview["steps_seen"] == summary["steps"]["count"] == 60
    assert overview["primary"]["kind"] == summary["primary_diagnosis"]["kind"]
    assert [f["kind"] for f in overview["findings"]] == [f["kind"] for f in summary["findings"]]
    assert overview["step"]["median_ms"] == summary["phases"]["step"]["median_ms"]
    assert overview["phases"]["forward"]["share"] == summary["phases"]["forward"]["share"] > 0
    assert overview["goodput"] == summary["goodput"] and summary["goodput"]["training"]["share"] > 0


def test_step_series_phases_add_up_to_the_step(served):
    base, run_dir = served
    series = get(base, "/api/steps")
    assert series["first_step"] == 0 and series["last_step"] == 59 and series["bucket_steps"] == 1
    assert series["step"] == list(range(60))
    with sqlite3.connect(run_dir / "telemetry.sqlite") as db:
        step_ms = [row[0] for row in db.execute("SELECT step_ms FROM steps ORDER BY step")]
    assert series["step_ms"] == pytest.approx(step_ms)
    for index, total in enumerate(series["step_ms"]):
        parts = sum(series["phases"][name][index] for name in STEP_PHASES)
        assert parts == pytest.approx(total, abs=0.01)
    assert all(value > 0 for value in series["memory"]["host_rss_bytes"])
    assert series["capacity"]["host_bytes"] > 0

    coarse = get(base, "/api/steps?points=7")
    assert coarse["bucket_steps"] == 16 and len(coarse["step"]) == 4  # 60 steps, 16 a point
    # Bucket means weighted by their steps give back the run's mean step.
    weights = [min(16, 60 - first) for first in coarse["step"]]
    weighted = sum(w * m for w, m in zip(weights, coarse["step_ms"])) / 60
    assert weighted == pytest.approx(sum(step_ms) / 60)

    zoomed = get(base, "/api/steps?start=10&end=19")
    assert zoomed["step"] == list(range(10, 20))
    assert zoomed["step_ms"] == pytest.approx(step_ms[10:20])


def test_timeline_holds_the_last_steps_and_their_spans(served):
    base, _ = served
    timeline = get(base, "/api/timeline?steps=5")
    assert timeline["ranks"] == [0]
    assert [row["step"] for row in timeline["steps"]] == [55, 56, 57, 58, 59]
    for row in timeline["steps"]:
        assert sum(row["phases"].values()) == pytest.approx(row["step_ms"], abs=0.01)
        assert row["phases"]["forward"] > 0 and row["phases"]["backward"] > 0
    starts = [row["start_unix_s"] for row in timeline["steps"]]
    assert starts == sorted(starts)
    spans = [span for span in timeline["spans"] if span["name"] == "compute"]
    assert [span["step"] for span in spans] == [55, 56, 57, 58, 59]
    assert all(span["count"] == 2 for span in spans)  # two micro-batches a step


def test_spans_scalars_and_layers(served):
    base, run_dir = served
    spans = get(base, "/api/spans")["spans"]
    assert [span["name"] for span in spans] == ["compute"]
    assert spans[0]["count"] == 120 and spans[0]["steps"] == 60
    assert 0.05 < spans[0]["share"] < 1.0
    scalars = get(base, "/api/scalars")["scalars"]
    assert scalars["lr"]["value"] == pytest.approx([0.01] * 60)
    assert scalars["loss"]["step"] == list(range(60))
    with sqlite3.connect(run_dir / "telemetry.sqlite") as db:
        losses = [row[0] for row in db.execute("SELECT value FROM scalars WHERE name = 'loss' ORDER BY step")]
    assert scalars["loss"]["value"] == pytest.approx(losses)
    layers = get(base, "/api/layers")
    assert layers["deep_dive"]["sampled_steps"] >= 5
    assert {row["name"] for row in layers["layers"]} >= {"0", "1", "2"}
    ranks = get(base, "/api/ranks")
    assert ranks["heatmap"]["ranks"] == [0] and len(ranks["heatmap"]["own_ms"][0]) == 60


def test_the_memory_ledger_is_the_summarys(served):
    base, run_dir = served
    summary = json.loads((run_dir / "final_summary.json").read_text())
    (row,) = summary["memory"]["ledger"]
    memory = get(base, "/api/memory")
    (served_row,) = memory["ledger"]
    parts = served_row["parts"]
    assert parts["parameters_trainable"] == row["parameters"]["trainable"] > 0
    assert parts["parameters_frozen"] == row["parameters"]["frozen"] == 0
    assert parts["optimizer_state"] == row["optimizer_state"] and parts["rest"] == row["rest"]
    assert all(isinstance(value, int) and value >= 0 for value in parts.values())
    assert set(parts) <= set(memory["parts"]) and memory["history"]
    assert [h["step"] for h in memory["history"]] == sorted(h["step"] for h in memory["history"])


def test_the_memory_ledger_of_a_lora_run_on_a_device(tmp_path):
    # A store as a CUDA LoRA fine-tune leaves it, summarized as a run cut short is (no
    # final_summary.json): the device peak bounds the bar, the adapters get their line.
    store = Store(str(tmp_path / "telemetry.sqlite"))
    mib = 2 ** 20
    store.write([RankHello(0, 0, 1, 0, "h", 1, "cuda:0", "H200", 140 * 2 ** 30, "2", ["lora.py"], 0.0)])
    store.write([StepRecord(0, step, step * 0.01, 10.0, 0, 0, 0, 5, 4, 1, 0, 0, 0, 1, 8,
                            device_peak_bytes=(500 + step) * mib, device_reserved_bytes=600 * mib)
                 for step in range(20)])
    ledger = dict(trainable_bytes=mib, frozen_bytes=200 * mib, trainable_dtypes={"float32": mib},
                  frozen_dtypes={"bfloat16": 200 * mib}, parameters=100_262_144, trainable_parameters=262_144,
                  gradient_bytes=mib, optimizer_state_bytes={"AdamW": 2 * mib}, adapter="LoRA", adapter_rank=8,
                  adapter_parameters=262_144, adapter_parameter_bytes=mib, adapter_gradient_bytes=mib,
                  adapter_optimizer_bytes=2 * mib, adapter_targets={"v_proj": mib // 2, "q_proj": mib // 2})
    store.write([MemoryLedger(0, 0, 0.0, **ledger),
                 MemoryLedger(0, 10, 0.1, **ledger, activation_bytes=50 * mib, activation_step=10)])
    store.commit()
    store.close()
    source = RunSource.of_finished_run(tmp_path)
    try:
        memory = worded_memory(source.memory())  # what /api/memory answers
    finally:
        source.close()
    (row,) = memory["ledger"]
    assert row["measured_on"] == "device_peak" and row["held"] == 519 * mib and row["activations_step"] == 10
    assert row["parts"] == {"parameters_frozen": 200 * mib, "parameters_trainable": mib, "gradients": mib,
                            "optimizer_state": 2 * mib, "activations": 50 * mib, "rest": 265 * mib, "cache": 81 * mib}
    assert list(row["parts"]) == [part for part in memory["parts"] if part in row["parts"]]  # the bar's order
    assert row["adapters"].startswith("LoRA r=8 on q_proj, v_proj: 1.0 MiB trainable")
    assert [(h["step"], h["activations"]) for h in memory["history"]] == [(0, 0), (10, 50 * mib)]
    assert memory["words"]["optimizer_state"] == "optimizer state"


@pytest.mark.parametrize("query", ["/api/steps?points=abc", "/api/steps?points=0",
                                   f"/api/steps?points={MAX_POINTS + 1}", "/api/steps?start=-3",
                                   "/api/timeline?steps=1000", "/api/system?points=1.5",
                                   "/api/ranks?points="+"9" * 30])
def test_bad_query_parameters_get_a_400(served, query):
    base, _ = served
    answer = get(base, query, expect=400)
    assert answer["error"]


@pytest.mark.parametrize("path", ["/assets/../../cli.py", "/assets/..%2f..%2fcli.py",
                                  "/assets/queries.py", "/assets/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
                                  "/../../../etc/passwd", "/api/../../etc/passwd", "/telemetry.sqlite",
                                  "/final_summary.json"])
def test_nothing_but_the_page_and_its_assets_is_served(served, path):
    base, _ = served
    body = get(base, path, expect=404)
    assert b"root:" not in body and b"import" not in body


def test_assets_come_from_installed_packages_and_the_server_is_read_only(served):
    base, run_dir = served
    plotly = get(base, "/assets/plotly.min.js")
    assert len(plotly) > 1_000_000 and b"plotly" in plotly[:2000].lower()
    page = get(base, "/").decode()
    assert "/assets/plotly.min.js" in page and "/assets/app.js" in page
    for text in (page, get(base, "/assets/app.js").decode()):
        assert not re.search(r"https?://(?!127\.0\.0\.1)", text), "the page must not load from the network"
    before = {path.name: path.stat().st_mtime_ns for path in run_dir.iterdir()}
    request = urllib.request.Request(base + "api/overview", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 405
    assert {path.name: path.stat().st_mtime_ns for path in run_dir.iterdir()} == before


def test_the_stream_of_a_finished_run_sends_its_overview_then_ends(served):
    base, _ = served
    with urllib.request.urlopen(base + "api/stream", timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = re.findall(r"event: (\w+)\ndata: (.*)\n\n", text)
    assert [name for name, _ in events] == ["overview", "end"]
    assert json.loads(events[0][1])["steps_seen"] == 60


def test_a_taken_port_moves_to_the_next_free_one(finished_run):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    web = WebServer(RunSource.of_finished_run(finished_run), "127.0.0.1", port)
    try:
        note = web.start()
        assert note == f"port {port} is in use; the dashboard is on port {web.port} instead"
        assert port < web.port <= port + 20
        assert get(web.url, "/api/overview")["steps_seen"] == 60
    finally:
        web.stop()
        taken.close()


# -- downsampling a long run ---------------------------------------------------------------------
def test_a_long_run_is_downsampled_and_refreshed_incrementally(tmp_path):
    store = Store(str(tmp_path / "telemetry.sqlite"))
    store.write([RankHello(rank, rank, 2, 0, "h", 1, "cpu", "cpu", None, "2", ["x"], 0.0) for rank in (0, 1)])

    def steps(first, last):
        for begin in range(first, last, 20000):
            store.write([StepRecord(rank, step, step * 0.01, 10.0 + rank * 5.0, 1, 1, 0, 3, 4, 1, 0.5 + rank * 5.0,
                                    0, 0, 1, 8, host_rss_bytes=1000 + step)
                         for step in range(begin, min(last, begin + 20000)) for rank in (0, 1)])
        store.commit()

    steps(0, 100_000)
    store.write([ScalarRecord(0, step, "loss", 1.0 if step < 50_000 else 3.0) for step in range(100_000)])
    store.commit()
    reader = Store(store.path, readonly=True)
    buckets = queries.step_buckets(reader)
    buckets.refresh()
    series = queries.step_series(buckets, {})
    assert buckets.bucket == 64 and len(series["step"]) == 1563 <= MAX_POINTS
    assert series["step_ms"][0] == pytest.approx(12.5)  # the mean of 10 ms and 15 ms ranks
    assert series["step_max_ms"][0] == 15.0
    assert series["memory"]["host_rss_bytes"][-1] == 1000 + 99_999  # the bucket's maximum
    own_time = queries.own_time_buckets(reader)
    own_time.refresh()
    heatmap = queries.rank_heatmap(own_time)  # no comm wait measured: a rank's own time is its step
    assert heatmap["ranks"] == [0, 1] and not heatmap["comm_wait_measured"]
    assert set(heatmap["own_ms"][0]) == {10.0} and set(heatmap["own_ms"][1]) == {15.0}

    coarse = queries.step_series(buckets.coarsen(100), {})  # 1024 steps a point
    assert len(coarse["step"]) == 98 and coarse["step"][:2] == [0, 1024]
    assert coarse["step_ms"] == pytest.approx([12.5] * 98)
    assert coarse["phases"]["forward"][0] == pytest.approx(3.0)
    assert coarse["memory"]["host_rss_bytes"][0] == 1000 + 1023

    scalars = queries.scalar_buckets(reader)
    scalars.refresh()
    loss = queries.scalar_series(scalars.coarsen(50))["scalars"]["loss"]
    assert len(loss["value"]) == 49 and loss["step"][0] == 0
    assert loss["value"][0] == 1.0 and loss["value"][-1] == 3.0

    steps(100_000, 120_000)  # the run goes on: only the newest buckets are read again
    buckets.refresh()
    series = queries.step_series(buckets, {})
    assert series["last_step"] == 119_999 and len(series["step"]) == 1875
    assert queries.training_ms(buckets) == pytest.approx(120_000 * 25.0)

    steps(120_000, 140_000)  # past 128k steps: 128 a bucket, made by merging pairs, not re-read
    buckets.refresh()
    fresh = queries.step_buckets(reader)
    fresh.refresh()
    assert buckets.bucket == fresh.bucket == 128
    assert queries.step_series(buckets, {}) == queries.step_series(fresh, {})
    store.close()


def test_a_downsampled_system_bucket_takes_its_gpus_from_its_last_reading(tmp_path):
    # Four readings a bucket whose GPU figures disagree: the series shows each bucket's last,
    # as a bare column beside MAX() aggregates would not (SQLite picks any row of the group).
    store = Store(str(tmp_path / "telemetry.sqlite"))
    readings = 4000
    store.write([SystemSample(unix_s=1000.0 + second, cpu_percent=float(second % 4), ram_used_bytes=100 + second,
                              ram_total_bytes=10_000, training_cpu_percent=50.0, training_rss_bytes=second,
                              gpus=[GpuSample(index=0, utilization_percent=float(second % 4) * 10,
                                              memory_used_bytes=second, memory_total_bytes=1 << 30)])
                 for second in range(readings)])
    store.commit()
    series = queries.system_series(Store(store.path, readonly=True), points=1000)
    assert len(series["unix_s"]) == 1000  # 4 readings a bucket
    gpu = series["gpus"][0]
    assert gpu["utilization_percent"] == [30.0] * 1000  # the last of 0, 10, 20, 30
    assert gpu["memory_used_bytes"] == list(range(3, readings, 4))
    assert series["cpu_percent"] == [1.5] * 1000  # the mean of 0, 1, 2, 3
    assert series["training_rss_bytes"] == list(range(3, readings, 4))  # the bucket's maximum
    store.close()


# -- live: traceml run --mode dashboard ----------------------------------------------------------
def test_live_dashboard_follows_the_run_then_closes(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--mode", "dashboard", "--port", "0",
         "--run-dir", str(run_dir), str(TRAIN_LOOP), "--steps", "400", "--load-ms", "1.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    try:
        base, _ = read_url(process)
        deadline = time.monotonic() + 60
        while True:
            overview = get(base, "/api/overview")
            if overview["steps_seen"] >= 30 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert overview["live"] is True and 30 <= overview["steps_seen"] < 400
        assert overview["primary"]["kind"] == "INPUT_BOUND"
        with urllib.request.urlopen(base + "api/stream", timeout=10) as response:
            first = response.readline().decode() + response.readline().decode()
        assert first.startswith("event: overview\ndata: ")
        assert json.loads(first.split("data: ", 1)[1])["live"] is True
        # The store commits every half second: its series trails the live overview a little.
        while len((series := get(base, "/api/steps"))["step"]) < 30 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(series["step"]) >= 30 and series["phases"]["input_wait"][-1] > 5.0
        # The ledger, live: the collector's readings, the live state's rows.
        while not (memory := get(base, "/api/memory"))["ledger"] and time.monotonic() < deadline:
            time.sleep(0.2)
        (row,) = memory["ledger"]
        assert row["rank"] == 0 and row["measured_on"] == "host_rss" and row["parts"]["parameters_trainable"] > 0
        assert all(isinstance(value, int) and value >= 0 for value in row["parts"].values())
        assert memory["history"] and {h["rank"] for h in memory["history"]} == {0}
        stdout, stderr = process.communicate(timeout=120)
    finally:
        stop(process)
    assert process.returncode == 0
    assert "traceml: reopen the dashboard with: traceml view" in stderr
    assert (run_dir / "final_summary.json").is_file()
    assert not (run_dir / "telemetry.sqlite-wal").exists()  # the store is one file again
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "api/overview", timeout=2)


def test_traceml_view_serves_a_run_until_interrupted(finished_run, tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "traceml", "view", str(finished_run), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        base, _ = read_url(process, timeout_s=30)
        assert get(base, "/api/overview")["steps_seen"] == 60
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        stop(process)


@pytest.mark.parametrize("args, message", [
    (["view", "/no/such/run"], "traceml: no such run directory: /no/such/run"),
    (["view", ".", "--port", "http"], "argument --port: not a port number: 'http'"),
    (["run", "--mode", "dashboard", "--port", "70000", "x.py"], "port 70000 is out of range"),
])
def test_bad_view_input_gets_one_clear_line(tmp_path, args, message):
    process = subprocess.run([sys.executable, "-m", "traceml", *args], capture_output=True,
                             text=True, timeout=30, cwd=tmp_path, env=_env())
    assert process.returncode == 2
    assert message in process.stderr
    assert "Traceback" not in process.stderr


# -- the seed API script, unchanged ----------------------------------------------------------------
def test_seed_api_script_serves_its_dashboard_and_records_spans_and_scalars(tmp_path):
    process = subprocess.Popen([sys.executable, str(SEED), "--epochs", "12"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    try:
        base, _ = read_url(process)
        port = int(base.rsplit(":", 1)[1].strip("/"))
        assert 8080 <= port <= 8099  # Trace(port=8080), or the next free port
        overview = get(base, "/api/overview")
        assert overview["live"] is True and overview["script"] == "training_loop"
        stdout, stderr = process.communicate(timeout=180)
    finally:
        stop(process)
    assert process.returncode == 0, stderr
    assert "final loss" in stdout and "TraceML" in stdout
    run_dir = next((tmp_path / "traceml_runs").glob("*-training_loop"))
    steps = 12 * 64  # 2048 samples in batches of 32, twelve epochs; one step per optimizer.step()
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["steps"]["count"] == steps
    assert summary["phases"]["forward"]["mean_ms"] > 0 and summary["phases"]["optimizer"]["mean_ms"] > 0
    with sqlite3.connect(run_dir / "telemetry.sqlite") as db:
        spans = dict(db.execute("SELECT name, SUM(count) FROM spans GROUP BY name").fetchall())
        losses = [row[0] for row in db.execute(
            "SELECT value FROM scalars WHERE name = 'train_loss' ORDER BY step")]
        forward_calls = db.execute("SELECT MIN(forward_calls), MAX(forward_calls) FROM steps").fetchone()
    assert spans == {"forward_pass": steps, "backward_pass": steps}
    assert len(losses) == steps
    assert sum(losses[-64:]) < sum(losses[:64]) / 2  # it learns, and the logged loss shows it
    assert forward_calls == (1, 1)  # the model, found at the first step; the loss module is not it


# -- a real browser --------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"


@pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("TRACEML_REQUIRE_BROWSER"),
                    reason="Debian's chromium is not installed (.ci/run installs it)")
def test_browser_renders_the_live_page_mid_run(tmp_path):
    from playwright.sync_api import sync_playwright

    docs_shot = Path(os.environ.get("TRACEML_DOCS_SCREENSHOT") or ARTIFACTS / "dashboard-docs.png")
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--mode", "dashboard", "--port", "0", "--deep",
         "--run-dir", str(run_dir), str(TRAIN_LOOP), "--steps", "600", "--load-ms", "1.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    try:
        base, _ = read_url(process)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            errors = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.goto(base)
            page.wait_for_function("Number(document.querySelector('#steps-seen').textContent) >= 20",
                                   timeout=60000)
            page.wait_for_selector('body[data-rendered="1"]', timeout=30000)
            page.wait_for_timeout(2500)  # one live refresh of the charts
            assert page.inner_text("#live-status") == "live"
            shown_steps = int(page.inner_text("#steps-seen"))
            overview = get(base, "/api/overview")
            assert 20 <= shown_steps <= overview["steps_seen"] < 600
            assert page.inner_text("#verdict") == "INPUT_BOUND" == overview["primary"]["kind"]
            assert page.locator('#findings .finding[data-kind="INPUT_BOUND"]').count() == 1
            # Goodput so far: the training share as a percentage, startup beside it.
            assert re.fullmatch(r"\d{1,3}%", page.inner_text("#goodput"))
            assert "startup" in page.inner_text("#goodput-rest") and overview["goodput"]["training"]["share"] > 0
            median = float(page.inner_text("#step-median").split()[0])
            assert median == pytest.approx(overview["step"]["median_ms"], rel=0.5)
            # The stacked phases: one trace per phase, as many points as the API's series.
            traces = page.evaluate("document.getElementById('chart-phases').data.map("
                                   "t => [t.name, t.x.length, t.stackgroup || null])")
            stacked = [trace for trace in traces if trace[2]]
            assert len(stacked) == len(STEP_PHASES)
            assert all(trace[1] >= 20 for trace in stacked)
            assert page.evaluate("document.getElementById('chart-timeline').data.length") >= 4
            assert page.evaluate("document.getElementById('chart-memory').data.length") >= 1
            # The ledger: a stacked bar per rank, a part a trace, and the readings over steps.
            ledger = page.evaluate("document.getElementById('chart-ledger').data.map(t => [t.name, t.y])")
            assert {"trainable parameters", "gradients", "the rest"} <= {name for name, _ in ledger}
            assert all(ranks == ["rank 0"] for _, ranks in ledger)
            assert page.evaluate("document.getElementById('chart-ledger-history').data.length") >= 2
            memory_text = page.inner_text("#sec-memory")
            assert "optimizer state" in memory_text and "host RSS at its highest" in memory_text
            assert page.locator("#phase-breakdown tr[data-phase]").count() >= len(STEP_PHASES)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)
            # Deep-dive layers arrive within a few refreshes; the table sorts on a click.
            page.wait_for_function("document.querySelectorAll('#layers-table tbody tr').length >= 3",
                                   timeout=30000)
            # The docs' picture of the dashboard: the top of the page as a person first sees it
            # (scripts/docs_screenshot.sh points TRACEML_DOCS_SCREENSHOT at docs/assets/).
            docs_shot.parent.mkdir(parents=True, exist_ok=True)
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(docs_shot), clip={"x": 0, "y": 0, **DOCS_SHOT_SIZE})
            # Decoded in a blank page of its own, to count its colours.
            colours = browser.new_page().evaluate(COUNT_COLOURS, base64.b64encode(docs_shot.read_bytes()).decode())
            page.click('#layers-table th[data-key="name"]')
            names = page.eval_on_selector_all("#layers-table tbody tr td:first-child",
                                              "cells => cells.map(c => c.textContent)")
            assert names == sorted(names, reverse=True)
            assert not errors, errors
            browser.close()
        process.communicate(timeout=120)
    finally:
        stop(process)
    assert process.returncode == 0
    assert (ARTIFACTS / "dashboard-live.png").stat().st_size > 20_000
    width, height = png_size(docs_shot)
    assert (width, height) == (DOCS_SHOT_SIZE["width"], DOCS_SHOT_SIZE["height"])
    # A page that drew: charts and text give many colours; a blank or half-loaded page gives few.
    assert colours > 1000, f"{docs_shot} shows {colours} colours: a blank page?"


DOCS_SHOT_SIZE = {"width": 1400, "height": 1300}
COUNT_COLOURS = """async (png) => {
    const image = new Image();
    image.src = "data:image/png;base64," + png;
    await image.decode();
    const canvas = document.createElement("canvas");
    [canvas.width, canvas.height] = [image.width, image.height];
    const context = canvas.getContext("2d");
    context.drawImage(image, 0, 0);
    const pixels = context.getImageData(0, 0, image.width, image.height).data, seen = new Set();
    for (let i = 0; i < pixels.length; i += 4) seen.add((pixels[i] << 16) | (pixels[i + 1] << 8) | pixels[i + 2]);
    return seen.size;
}"""


def png_size(path):
    """(width, height) from a PNG file's header; fails on a file that is not a PNG."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])
