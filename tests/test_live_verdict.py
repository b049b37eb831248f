"""The live verdict at a run's end is the card's: a real run's stored records, replayed through a
collector as they would arrive, give the live views the findings the final summary gives."""
import json

import msgspec
import pytest

from traceml.analysis.goodput import RunTime
from traceml.analysis.rollup import LiveRollup
from traceml.collector.server import Collector
from traceml.collector.store import Store
from traceml.records import (CompileRecord, HostSyncSample, LayerCapture, LayerReport, LoaderSample, MemoryLedger, OomRecord,
                             RankEnd, RankHello, SystemSample)
from traceml.report.live import snapshot


def replayed_live_state(run_dir):
    """The live state of a collector fed the run's stored records: hellos first, then the steps
    in step order with the rest, then the goodbyes."""
    stored = Store(str(run_dir / "telemetry.sqlite"), readonly=True)
    try:
        collector = Collector(Store(":memory:"), live=LiveRollup(), run_time=RunTime())
        for hello in stored.records(RankHello):
            collector._greet(hello)
            collector.ingest([hello])
        steps = sorted(stored.steps(), key=lambda record: (record.step, record.rank))
        collector.ingest(steps)
        collector.ingest([record for record_type in (SystemSample, OomRecord, CompileRecord, HostSyncSample, LayerCapture,
                                                     LoaderSample, MemoryLedger, LayerReport)
                          for record in stored.records(record_type)])
        collector.ingest(stored.records(RankEnd))
    finally:
        stored.close()
    return snapshot(collector, "train.py", 10.0, alerts=[])


def told(findings):
    return [(f["kind"], f["severity"], f["rank"], f["summary"]) for f in findings]


def assert_live_is_final(run):
    summary = json.loads((run.run_dir / "final_summary.json").read_text())
    live = replayed_live_state(run.run_dir)
    assert told(msgspec.to_builtins(live.findings)) == told(summary["findings"])
    return summary


@pytest.mark.serial  # judges which steps stand out; another test beside it made some (under -n 2)
def test_the_live_verdict_at_the_end_of_a_periodic_stall_is_the_final_one(traceml_run):
    # 60 ms of work between steps every 10th step: the periodic stall is the verdict. (An OOM's
    # live verdict is test_deep_dive's, on its own run.)
    run = traceml_run("--steps", 120, "--no-loader", "--stall-every", 10, "--stall-ms", 60,
                      traceml_args=("--mode", "summary"))
    assert run.returncode == 0, run.stderr
    primary = assert_live_is_final(run)["primary_diagnosis"]
    assert primary["evidence"].get("period_steps") == 10, primary
