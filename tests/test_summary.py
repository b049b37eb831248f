"""Summary and card from a store filled with synthetic records: figures, contract, width."""
import json
import subprocess
import sys

import msgspec
import pytest

from traceml.collector.store import Store
from traceml.records import Finding, GpuSample, RankEnd, SpanRecord, SystemSample
from traceml.report.summary import RunData, RunFacts, build_summary
from traceml.views.report import render_report
from traceml.views.summary import CARD_WIDTH, card_text
from test_records import hello, step

GIB = 1024 ** 3


def filled_store(tmp_path, steps=40, with_gpu=False):
    store = Store(str(tmp_path / "telemetry.sqlite"))
    first = hello()
    records = [first]
    for index in range(steps):
        record = step(index)
        record.input_wait_ms, record.forward_ms, record.outside_ms = 6.0, 1.0, 0.5  # step is 10 ms
        record.host_rss_bytes = 500 * 2 ** 20 + index * 4096  # grows a page a step
        records.append(record)
    gpus = [GpuSample(index=0, utilization_percent=37.0, memory_used_bytes=3 * GIB,
                      memory_total_bytes=80 * GIB, temperature_c=50.0, power_w=200.0)] if with_gpu else []
    records += [SystemSample(unix_s=1.0 + i, cpu_percent=40.0 + 20 * i, ram_used_bytes=(4 + i) * GIB,
                             ram_total_bytes=16 * GIB, training_cpu_percent=90.0,
                             training_rss_bytes=GIB, gpus=gpus) for i in range(2)]
    records.append(RankEnd(rank=0, exit_code=0, records_sent=steps, records_dropped=7))
    store.write(records)
    store.commit()
    return store


FACTS = RunFacts(script="train.py", argv=["train.py", "--lr", "1e-3"], exit_code=0,
                 started_at_unix_s=1_800_000_000.0, ended_at_unix_s=1_800_000_012.5)


def test_summary_figures_come_from_the_records(tmp_path):
    summary = build_summary(RunData(filled_store(tmp_path)), FACTS)
    assert summary["steps"] == {"count": 40, "warmup_excluded": 4, "measured": 36,
                                "records_dropped": 7, "device_timed": False,
                                "found_by": None, "warmup_transients": [],
                                "rank_figures_every_n_steps": 1}
    assert summary["phases"]["input_wait"] == {"median_ms": 6.0, "mean_ms": 6.0, "share": 0.6}
    assert summary["phases"]["step"]["median_ms"] == 10.0
    assert summary["throughput"]["steps_per_s"] == pytest.approx(100.0)
    assert summary["throughput"]["samples_per_s"] == pytest.approx(800.0)
    assert summary["memory"]["creep_bytes_per_step"] == pytest.approx(4096.0)
    assert summary["memory"]["host_rss_peak_bytes"] == 500 * 2 ** 20 + 39 * 4096
    assert summary["system"]["cpu_percent"] == {"avg": 50.0, "peak": 60.0}
    assert summary["run"]["duration_s"] == 12.5
    assert summary["run"]["started_at"] == "2027-01-15T08:00:00+00:00"
    assert summary["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    json.dumps(summary)  # plain JSON all the way down


def test_findings_are_stored_with_the_run(tmp_path, capsys):
    from traceml.lifecycle import finish_run

    store = filled_store(tmp_path)
    summary = finish_run(store, tmp_path, FACTS)
    reader = Store(str(tmp_path / "telemetry.sqlite"), readonly=True)
    stored = reader.records(Finding)
    reader.close()
    assert [f.kind for f in stored] == [f["kind"] for f in summary["findings"]]
    assert stored[0].kind == "INPUT_BOUND"


def test_card_fits_100_columns_and_shows_the_figures(tmp_path):
    summary = build_summary(RunData(filled_store(tmp_path, with_gpu=True)), FACTS)
    card = card_text(summary)
    lines = card.splitlines()
    assert max(len(line) for line in lines) <= CARD_WIDTH
    assert "INPUT_BOUND" in card
    assert "input wait is 60% of the step: 6.0 ms of 10.0 ms" in card
    assert "median 10.0 ms" in card and "p90 10.0 ms" in card
    assert "100.00 steps/s" in card and "800.0 samples/s" in card
    assert "CPU avg 50% peak 60%" in card
    unwrapped = " ".join(word for word in card.split() if word != "│")
    assert "GPU0 util avg 37%, mem peak 3.0 of 80.0 GiB, 50 °C peak, 200 W avg" in unwrapped
    assert summary["system"]["gpus"][0]["power_w"] == {"avg": 200.0, "peak": 200.0}
    assert "7 records dropped" in card
    phase_line = next(line for line in lines if "input wait" in line and "%" in line)
    assert "6.00" in phase_line and "60.0%" in phase_line
    # Every label's value starts in one column, above the phase table and below it, the
    # verdict's kind too, spelled as the JSON spells it.
    def value_column(label):
        line = next(line for line in lines if line.startswith(f"│ {label} "))
        return len(line) - len(line[len(f"│ {label}"):].lstrip())
    columns = {label: value_column(label) for label in ("Run", "Steps", "Step time", "Verdict", "Why", "Next", "Also")}
    assert len(set(columns.values())) == 1, columns
    assert "Verdict    INPUT_BOUND" in card


def test_report_is_self_contained_with_its_charts(tmp_path):
    data = RunData(filled_store(tmp_path))
    html = render_report(build_summary(data, FACTS), data.rolled)
    assert "<svg id='phase-bar'" in html and "<svg id='step-chart'" in html
    assert "INPUT_BOUND" in html
    assert "src=" not in html and "http" not in html  # nothing fetched from anywhere


def test_import_traceml_is_light():
    code = ("import sys, traceml; heavy = [m for m in ('torch', 'msgspec', 'rich', 'psutil', "
            "'sqlite3', 'asyncio', 'transformers', 'lightning', 'pytorch_lightning', 'accelerate', "
            "'starlette', 'uvicorn', 'plotly') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_long_run_reads_rolled_steps_and_samples_records_for_rank_figures(tmp_path):
    """Past 10k steps the summary reads the collector's rolled steps and every k-th step's
    records for the per-rank medians; counts and last steps stay exact."""
    from traceml.analysis.rollup import roll_up

    store = Store(str(tmp_path / "telemetry.sqlite"))
    store.write([msgspec.structs.replace(hello(), rank=rank, world_size=2) for rank in (0, 1)])
    records = [msgspec.structs.replace(step(n), rank=rank, step_ms=10.0 + 5.0 * rank,
                                       input_wait_ms=1.0 + 5.0 * rank)
               for n in range(25_000) for rank in (0, 1) if rank == 0 or n < 24_990]
    store.write(records)
    store.write(roll_up(records))
    store.set_meta({"rolled_complete": True})
    data = RunData(store)
    assert data.rank_sample_every == 2 and len(data.records) < len(records) // 2 + 10
    summary = build_summary(data, FACTS)
    assert summary["steps"]["count"] == 25_000 and summary["steps"]["rank_figures_every_n_steps"] == 2
    rank0, rank1 = summary["ranks"]
    assert (rank0["steps"], rank0["last_step"]) == (25_000 - 5, 24_999)  # exact, not sampled
    assert (rank1["steps"], rank1["last_step"]) == (24_990 - 5, 24_989)
    assert rank0["step_median_ms"] == 10.0 and rank1["step_median_ms"] == 15.0
    assert summary["missing_ranks"] == [{"rank": 1, "from_step": 24_990}]
    assert summary["phases"]["step"]["median_ms"] == 12.5  # the rolled steps: median across ranks


def test_span_figures_of_a_long_two_rank_run_count_only_measured_steps(tmp_path):
    """Spans over 25k steps of two ranks (medians sampled, every 2nd of each name's steps): a
    span on odd steps only still has its median; calls in warm-up, or in a step with no record
    (the unfinished last one), count nowhere; shares are of every rank's step time."""
    from traceml.analysis.rollup import roll_up

    store = Store(str(tmp_path / "telemetry.sqlite"))
    store.write([msgspec.structs.replace(hello(), rank=rank, world_size=2) for rank in (0, 1)])
    records = [msgspec.structs.replace(step(n), rank=rank, step_ms=10.0 + 10.0 * rank)
               for n in range(25_000) for rank in (0, 1)]
    # rank 0's odd steps: two calls, 4 ms in all, and 100 ms in every fourth of them.
    spans = [SpanRecord(0, n, "odd", 1.0 + n, 100.0 if n % 8 == 1 else 4.0, 2) for n in range(1, 25_000, 2)]
    spans += [SpanRecord(1, 25_000, "odd", 1.0, 50.0, 1), SpanRecord(1, 0, "warmup_only", 1.0, 7.0, 1)]
    store.write(records + spans)
    store.write(roll_up(records))
    store.set_meta({"rolled_complete": True})
    data = RunData(store)
    assert data.rank_sample_every == 2 and data.warmup == 5
    summary = build_summary(data, FACTS)
    measured = [n for n in range(5, 25_000) if n % 2 == 1]  # rank 0's odd steps after warm-up
    total_ms = sum(100.0 if n % 8 == 1 else 4.0 for n in measured)
    assert summary["spans"] == {"odd": {"count": 2 * len(measured), "steps": len(measured), "median_ms": 4.0,
                                        "total_ms_per_step": round(total_ms / (2 * 24_995), 4),
                                        "share": round(total_ms / (24_995 * (10.0 + 20.0)), 4)}}
    card = card_text(summary)
    assert "user spans" in card and "warmup_only" not in card
