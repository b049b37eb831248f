"""After a run: compare two runs, export a trace, scrape /metrics live, traceml.summary()."""
import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import SCRIPTS, TRAIN_LOOP, Run, _env, ddp_input_straggler, ended_well
from test_web import get, read_url, stop


# The runs compared, made once (one worker: --dist loadgroup) for every test that reads them.
compared = pytest.mark.xdist_group("compared_runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A slow-loader run and the same loop fixed (its batches built in memory: a DataLoader of 8
    samples costs 0.3-0.6 ms a batch by itself, right on INPUT_BOUND's 10% line for these
    short steps), the two at once, so that whatever the machine does meanwhile, it does to both."""
    tmp = tmp_path_factory.mktemp("compare")
    started = {}
    # 3 ms a sample: the step is mostly the loader's sleep, so that beside busy processes its
    # median still moves by less than the comparison's equivalence margin.
    for name, load_ms, extra in (("slow", 3.0, []), ("fixed", 0.0, ["--no-loader"])):
        started[name] = subprocess.Popen(
            [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", str(tmp / name),
             str(TRAIN_LOOP), "--steps", "300", "--load-ms", str(load_ms), "--outside-ms", "2", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp, env=_env())
    for name, process in started.items():
        _, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr
    return {name: tmp / name for name in started}


def compare(a, b, *extra):
    process = subprocess.run([sys.executable, "-m", "traceml", "compare", str(a), str(b), *extra],
                             capture_output=True, text=True, timeout=120, env=_env())
    assert process.returncode == 0, process.stderr
    return process


@compared
def test_fixing_the_loader_is_an_improvement(runs):
    result = json.loads(compare(runs["slow"], runs["fixed"], "--json").stdout)
    # Beside other jobs, the load measured during one run may account for the change: then the
    # comparison says so rather than claim it.
    assert result["verdict"] == "IMPROVEMENT" or (
        result["verdict"] == "INCONCLUSIVE" and "enough to account for it" in result["reason"]), result["reason"]
    low, high = result["step"]["ci_share"]
    assert low <= high < -0.3  # 8 samples x 3 ms of a ~30 ms step are gone
    wait = result["phases"]["input_wait"]
    assert wait["median_a_ms"] >= 24.0 and wait["median_b_ms"] < 1.0 and wait["ci_ms"][1] < -21.0
    assert result["diagnosis"]["primary_a"] == "INPUT_BOUND"
    assert "INPUT_BOUND" in result["diagnosis"]["gone"]
    argv = next(row for row in result["environment"] if row["field"] == "argv")
    assert argv["differs"] and "--load-ms 3.0" in argv["a"] and "--load-ms 0.0" in argv["b"]
    batch = next(row for row in result["environment"] if row["field"] == "batch_size")
    assert batch["a"] == batch["b"] == 8 and not batch["differs"]


@compared
def test_a_run_against_itself_is_never_a_change(runs):
    # EQUIVALENT when its steps are steady enough for the interval to sit within ±5%; a machine
    # that jitters widens it (INCONCLUSIVE), and that is all it may do.
    result = json.loads(compare(runs["slow"], runs["slow"], "--json").stdout)
    assert result["verdict"] in ("EQUIVALENT", "INCONCLUSIVE"), result["reason"]
    assert result["step"]["delta_ms"] == 0.0
    low, high = result["step"]["ci_share"]
    assert low <= 0.0 <= high
    text = compare(runs["slow"], runs["slow"]).stdout
    assert result["verdict"] in text and "input wait" in text


@compared
def test_summary_files_alone_are_inconclusive_not_guessed(runs, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text((runs["slow"] / "final_summary.json").read_text())
    b.write_text((runs["fixed"] / "final_summary.json").read_text())
    result = json.loads(compare(a, b, "--json").stdout)
    assert result["verdict"] == "INCONCLUSIVE" and "a summary file without its telemetry.sqlite" in result["reason"]
    assert result["step"]["delta_ms"] < -5.0  # the medians still compare


@compared
def test_chrome_export_nests_per_rank_and_keeps_time_order(runs, tmp_path):
    out = tmp_path / "trace.json"
    process = subprocess.run([sys.executable, "-m", "traceml", "export", str(runs["slow"]), "--format",
                              "chrome", "--steps", "50:99", "--out", str(out)],
                             capture_output=True, text=True, timeout=60, env=_env())
    assert process.returncode == 0, process.stderr
    assert "50 step records written" in process.stderr
    events = json.loads(out.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    steps = [e for e in slices if e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == list(range(50, 100))
    assert {e["pid"] for e in events} == {0}
    assert any(e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"] == "rank 0" for e in events)
    by_track = {}
    for event in slices:
        by_track.setdefault((event["pid"], event["tid"]), []).append(event)
    for track in by_track.values():
        track.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends = []
        for event in track:  # proper nesting: a slice ends inside every slice it starts in
            while open_ends and open_ends[-1] <= event["ts"]:
                open_ends.pop()
            assert not open_ends or event["ts"] + event["dur"] <= open_ends[-1], event
            open_ends.append(event["ts"] + event["dur"])
    starts = [e["ts"] for e in steps]
    assert starts == sorted(starts) and starts[0] == 0
    phases = [e for e in slices if e["cat"] == "phase"]
    assert {"forward", "backward", "optimizer", "input_wait", "outside"} <= {e["name"] for e in phases}
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 50 and all(e["args"]["host_rss"] > 10 for e in counters)


@compared
def test_jsonl_and_csv_exports(runs, tmp_path):
    for fmt in ("jsonl", "csv"):
        process = subprocess.run([sys.executable, "-m", "traceml", "export", str(runs["fixed"]), "--format",
                                  fmt, "--out", "-"], capture_output=True, text=True, timeout=60, env=_env())
        assert process.returncode == 0, process.stderr
        lines = process.stdout.splitlines()
        if fmt == "jsonl":
            records = [json.loads(line) for line in lines]
            assert len(records) == 300 and records[0]["type"] == "step" and records[-1]["step"] == 299
        else:
            assert lines[0].startswith("rank,step,start_unix_s,step_ms,") and len(lines) == 301
    bad = subprocess.run([sys.executable, "-m", "traceml", "export", str(runs["fixed"]), "--format", "csv",
                          "--steps", "9:3"], capture_output=True, text=True, timeout=60, env=_env())
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "empty" in bad.stderr


# The live run, made once (one worker: --dist loadgroup) for the two tests that read it.
live = pytest.mark.xdist_group("live_run")


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A slow-loader run under `traceml run --mode dashboard`: its /metrics as scraped once 40
    steps were in, its content type, and the run, whose script prints traceml.summary() at its end."""
    tmp = tmp_path_factory.mktemp("live")
    process = subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--mode", "dashboard", "--port", "0", "--run-dir",
         str(tmp / "run"), str(TRAIN_LOOP), "--steps", "200", "--load-ms", "6", "--print-summary"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, env=_env())
    try:
        base, _ = read_url(process)
        deadline = time.monotonic() + 60
        while get(base, "/api/overview")["steps_seen"] < 40 and time.monotonic() < deadline:
            time.sleep(0.3)
        with urllib.request.urlopen(base + "metrics", timeout=10) as response:
            content_type, text = response.headers["content-type"], response.read().decode()
        stdout, stderr = process.communicate(timeout=120)
    finally:
        stop(process)
    ended = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return content_type, text, Run(ended, tmp / "run")


@live
def test_metrics_are_scraped_from_a_live_run(live_run):
    from prometheus_client.parser import text_string_to_metric_families

    content_type, text, _ = live_run
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    median = samples[("traceml_step_time_ms", (("quantile", "0.5"), ("rank", "0")))]
    p90 = samples[("traceml_step_time_ms", (("quantile", "0.9"), ("rank", "0")))]
    assert 48.0 <= median <= p90  # 8 samples x 6 ms of loading, at least
    share = samples[("traceml_phase_share", (("phase", "input_wait"), ("rank", "0")))]
    # 48 ms of sleep a step against about 1 ms of compute on a quiet machine; a machine busy
    # enough to make the rest of the step as long as the sleep still leaves it above 0.3.
    assert 0.3 < share < 1.0
    # The ledger: the loop's MLP, 32 -> 64 -> 64 -> 10 in fp32, all of it trained.
    ledger = {dict(labels)["part"]: value for (name, labels), value in samples.items()
              if name == "traceml_memory_ledger_bytes" and dict(labels)["rank"] == "0"}
    assert ledger["parameters_trainable"] == (32 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10) * 4
    assert ledger["parameters_frozen"] == 0 and ledger["rest"] > 0
    assert samples[("traceml_steps_total", (("rank", "0"),))] >= 40
    assert samples[("traceml_memory_bytes", (("kind", "host_rss"), ("rank", "0")))] > 2 ** 20
    assert samples[("traceml_samples_per_second", (("rank", "0"),))] > 0
    assert samples[("traceml_finding_active", (("kind", "INPUT_BOUND"), ("rank", ""), ("severity", "crit")))] == 1.0
    # Goodput so far: each part's share is its seconds over the run's so far, whatever a busy
    # machine makes of the startup (torch's imports); 40+ steps of at least 48 ms are training.
    parts = ("startup", "training", "evaluation", "checkpoint", "other")
    goodput = {part: samples[("traceml_goodput_share", (("part", part),))] for part in parts}
    seconds = {part: samples[("traceml_goodput_seconds", (("part", part),))] for part in parts}
    assert sum(goodput.values()) == pytest.approx(1.0, abs=1e-6)
    assert goodput == pytest.approx({part: seconds[part] / sum(seconds.values()) for part in parts}, abs=1e-3)
    assert seconds["training"] >= 40 * 0.048 and seconds["startup"] > 0.1 and seconds["evaluation"] == 0.0
    # The node's latest sample: the machine's CPU (100 = every core) and RAM.
    assert 0 < samples[("traceml_cpu_percent", (("scope", "machine"),))] <= 100
    assert 0 < samples[("traceml_ram_bytes", (("kind", "used"),))] < samples[("traceml_ram_bytes", (("kind", "total"),))]


def test_metrics_carry_each_gpu_as_nvml_reads_it():
    from types import SimpleNamespace

    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from traceml.collector.server import Collector
    from traceml.collector.store import Store
    from traceml.records import GpuSample, SystemSample
    from traceml.views.metrics import LiveMetrics

    gpus = [GpuSample(index=index, utilization_percent=97.0 - index, memory_used_bytes=(40 + index) * 2 ** 30,
                      memory_total_bytes=141 * 2 ** 30, temperature_c=61.0 + index, power_w=512.5)
            for index in range(2)]
    sample = SystemSample(unix_s=1.0, cpu_percent=12.5, ram_used_bytes=2 ** 34, ram_total_bytes=2 ** 37,
                          training_cpu_percent=180.0, training_rss_bytes=2 ** 32, gpus=gpus, cpu_count=16)
    collector = Collector(Store(":memory:"))
    collector.ingest([sample])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveMetrics(collector, lambda: SimpleNamespace(findings=[], goodput=None, ledger=[], layers=None)))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    assert samples[("traceml_gpu_utilization_percent", (("gpu", "1"),))] == 96.0
    assert samples[("traceml_gpu_memory_bytes", (("gpu", "0"), ("kind", "used")))] == 40 * 2 ** 30
    assert samples[("traceml_gpu_temperature_celsius", (("gpu", "1"),))] == 62.0
    assert samples[("traceml_gpu_power_watts", (("gpu", "0"),))] == 512.5
    assert samples[("traceml_cpu_percent", (("scope", "training"),))] == 180.0


def test_metrics_carry_each_ranks_comm_wait_where_it_was_measured():
    from types import SimpleNamespace

    import msgspec
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from test_records import step
    from traceml.collector.server import Collector
    from traceml.collector.store import Store
    from traceml.views.metrics import LiveMetrics

    # Rank 0 waited 2.5 ms of each 10 ms step in collectives (FSDP, 1.5 of it in forward);
    # rank 1's wait was never measured (a CUDA FSDP run): no figure rather than a zero.
    collector = Collector(Store(":memory:"))
    collector.ingest([msgspec.structs.replace(step(n), comm_wait_ms=2.5, forward_comm_wait_ms=1.5) for n in range(5)]
                     + [msgspec.structs.replace(step(n), rank=1) for n in range(5)])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveMetrics(collector, lambda: SimpleNamespace(findings=[], goodput=None, ledger=[], layers=None)))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    assert samples[("traceml_comm_wait_share", (("rank", "0"),))] == pytest.approx(0.25)
    assert ("traceml_comm_wait_share", (("rank", "1"),)) not in samples


@live
def test_summary_in_the_training_process_is_flat(live_run):
    *_, run = live_run  # 200 steps of 8 samples x 6 ms, the script's own traceml.summary() at the end
    assert run.returncode == 0, run.stderr
    line = next(line for line in run.stdout.splitlines() if line.startswith("SUMMARY "))
    flat = json.loads(line[len("SUMMARY "):])
    assert flat["traceml/steps"] >= 198  # all but the step still open when it was asked
    assert flat["traceml/diagnosis/primary"] == "INPUT_BOUND"
    assert 0.3 < flat["traceml/phase/input_wait/share"] < 1.0  # as in the /metrics test above
    assert flat["traceml/step/median_ms"] >= 48.0  # 8 samples x 6 ms
    assert all(isinstance(value, (int, float, str, type(None))) for value in flat.values())
    card = run.summary()
    assert flat["traceml/phase/input_wait/share"] == pytest.approx(card["phases"]["input_wait"]["share"], abs=0.05)


def test_tokens_per_second_counts_real_tokens_and_padding(traceml_run):
    run = traceml_run("--steps", 40, script=SCRIPTS / "token_loop.py")
    assert run.returncode == 0, run.stderr
    real = sum(8 + (3 * row) % 24 for row in range(8))  # 8 rows of 32 ids, the rest padding
    assert f"real tokens a step {real} of 256" in run.stdout
    rows = run.step_rows()
    assert all(row["tokens"] == 256 and row["real_tokens"] == real for row in rows)
    summary = run.summary()
    throughput = summary["throughput"]
    assert throughput["padding_share"] == pytest.approx(1 - real / 256, abs=1e-4)
    measured = rows[summary["steps"]["warmup_excluded"]:]
    expected = real * len(measured) / (sum(row["step_ms"] for row in measured) / 1000)
    assert throughput["tokens_per_s"] == pytest.approx(expected, rel=1e-3)
    assert f"{throughput['tokens_per_s']:,.0f} tokens/s ({1 - real / 256:.0%} padding)" in run.stdout


@pytest.mark.parametrize("shape, given", [
    (["hf"], 4 * 31), (["hf", "--padded"], 4 * 31), (["xy"], 4 * 32), (["chunk"], 4 * 32)],
    ids=["hf-labels-are-the-ids", "hf-padded-labels", "nanogpt-x-y-views", "decoder-slices-the-chunk"])
def test_tokens_per_second_counts_the_tokens_a_step_trains_on(traceml_run, shape, given):
    if shape[0] == "hf":
        pytest.importorskip("transformers")
    run = traceml_run("--shape", *shape, script=SCRIPTS / "trained_tokens.py", timeout=240)
    assert run.returncode == 0, run.stderr
    (trained,) = json.loads(re.search(r"^trained tokens a step (\[.*\])$", run.stdout, re.MULTILINE).group(1))
    rows = run.step_rows()
    assert len(rows) == 12
    # tokens: the positions a next token is predicted for (a causal LM given labels=input_ids
    # predicts none for its first); real tokens: those the loss counts (labels of -100 left out).
    assert all(row["tokens"] == given and (row["real_tokens"] or row["tokens"]) == trained for row in rows)
    summary = run.summary()
    measured = rows[summary["steps"]["warmup_excluded"]:]
    expected = trained * len(measured) / (sum(row["step_ms"] for row in measured) / 1000)
    assert summary["throughput"]["tokens_per_s"] == pytest.approx(expected, rel=1e-3)


@ddp_input_straggler
def test_report_html_holds_every_chart_of_a_ddp_deep_dive_run(ddp_input_straggler_run):
    run = ddp_input_straggler_run
    assert ended_well(run), run.stderr
    html = (run.run_dir / "report.html").read_text()
    summary = run.summary()
    for chart in ("phase-bar", "step-chart", "memory-chart", "rank-chart"):
        assert f"<svg id='{chart}'" in html, chart
    assert "<table id='rank-table'>" in html and "<table id='layer-table'>" in html
    assert html.count("<polyline") >= 3  # step time (median and slowest rank) and host RSS
    assert "node RAM: " in html and "far above" in html  # named, not drawn: it would flatten RSS
    primary = summary["primary_diagnosis"]
    assert f"data-kind='{primary['kind']}'" in html and "<div class='evidence'>" in html
    assert f"rank {primary['rank']}" in html  # INPUT_STRAGGLER names the rank
    first_layer = next(row for row in summary["layers"] if row["leaf"])
    assert f"<td>{first_layer['name']} ({first_layer['type']})</td>" in html
    assert "src=" not in html and "http" not in html  # self-contained


def test_flops_per_step_are_counted_once_under_deep_dive(traceml_run):
    run = traceml_run("--steps", 40, traceml_args=("--deep",))
    assert run.returncode == 0, run.stderr
    throughput = run.summary()["throughput"]
    # Linear 32->64, 64->64, 64->10 on 8 samples: forward 2*B*in*out each; backward twice that,
    # but for the first layer, whose input needs no gradient.
    batch, layers = 8, [(32, 64), (64, 64), (64, 10)]
    expected = sum(2 * batch * fan_in * fan_out * (2 if index == 0 else 3)
                   for index, (fan_in, fan_out) in enumerate(layers))
    assert throughput["flops_per_step"] == expected
    assert throughput["achieved_tflops"] == pytest.approx(expected * throughput["steps_per_s"] / 1e12, abs=1e-4)
    assert throughput["mfu"] is None  # a CPU's peak is not known: no made-up MFU
    assert "GFLOP/s (device peak unknown: no MFU)" in run.stdout


def test_device_peaks_for_mfu():
    from traceml.analysis.hardware import device_peak_tflops

    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert device_peak_tflops("NVIDIA L4") == 121.0 and device_peak_tflops("NVIDIA L40S") == 362.0
    assert device_peak_tflops("cpu") is None
