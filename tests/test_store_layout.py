"""Runs that last: a run directory written by an earlier TraceML opens in `traceml view`, `compare`
and `export`; a field added to a record reads as its default from a store written before it; a
store from a newer TraceML is refused in one line."""
import contextlib
import dataclasses
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import _env
from test_web import get, read_url

from traceml.collector import store as stores
from traceml.records import RankHello, StepRecord

# A 40-step run (--deep) written by TraceML 0.1.0 as of the hang locator, before the store kept
# its layout's number. Never regenerate it: it is what a user upgrading from that version holds.
EARLIER_RUN = Path(__file__).parent / "fixtures" / "run-0.1.0"


@pytest.fixture
def earlier_run(tmp_path):
    run_dir = tmp_path / "earlier"
    shutil.copytree(EARLIER_RUN, run_dir)  # opening a WAL store may leave its index beside it
    return run_dir


def traceml(*args, cwd):
    return subprocess.run([sys.executable, "-m", "traceml", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=_env())


def test_the_earlier_layout_has_no_number_and_reads_as_layout_1(earlier_run):
    path = earlier_run / "telemetry.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (0,)
    store = stores.Store(str(path), readonly=True)
    assert len(store.steps()) == len(store.rolled_steps()) == 40 and store.records(RankHello)[0].rank == 0
    store.close()


def test_an_earlier_run_opens_in_export_compare_and_view(earlier_run, tmp_path):
    for fmt, out in (("csv", "steps.csv"), ("jsonl", "records.jsonl"), ("chrome", "trace.json")):
        done = traceml("export", earlier_run, "--format", fmt, "--out", tmp_path / out, cwd=tmp_path)
        assert done.returncode == 0 and "40 step records written" in done.stderr, done.stderr
    assert len((tmp_path / "steps.csv").read_text().splitlines()) == 41
    # compare reads the store as well as the summary; without the summary, the store alone.
    without_summary = tmp_path / "without_summary"
    shutil.copytree(earlier_run, without_summary)
    (without_summary / "final_summary.json").unlink()
    done = traceml("compare", earlier_run, without_summary, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    compared = json.loads(done.stdout)
    assert compared["verdict"] in ("EQUIVALENT", "INCONCLUSIVE")  # the same steps, read two ways
    assert compared["step"]["delta_ms"] == 0.0 and compared["step"]["steps_a"] == compared["step"]["steps_b"] == 36
    process = subprocess.Popen([sys.executable, "-m", "traceml", "view", str(without_summary), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        base, _ = read_url(process, timeout_s=60)
        assert get(base, "/api/overview")["steps_seen"] == 40
        assert len(get(base, "/api/layers")["layers"]) > 0
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()


def test_a_field_added_to_a_record_reads_as_its_default_from_an_older_store(earlier_run, monkeypatch):
    class LaterStepRecord(StepRecord, tag="step"):  # as if the next version appended a field
        prefetch_ms: float = 1.5

    path = str(earlier_run / "telemetry.sqlite")
    earlier = [msgspec.structs.asdict(record) for record in stores.Store(path, readonly=True).steps()]
    later = dataclasses.replace(stores.RECORD_TYPES[StepRecord], record=LaterStepRecord)
    monkeypatch.setattr(stores, "RECORD_TYPES", {**stores.RECORD_TYPES, StepRecord: later, LaterStepRecord: later})
    store = stores.Store(path, readonly=True)
    later = store.steps()
    assert [record.prefetch_ms for record in later] == [1.5] * 40
    assert [{k: v for k, v in msgspec.structs.asdict(r).items() if k != "prefetch_ms"} for r in later] == earlier
    assert store.step_fields(0, 0, ["prefetch_ms"])[0] == (0, 1.5)
    assert store.bucketed("steps", 0, 0, 10, 0)[0][0] == 0  # the buckets' sums read it too
    store.close()
    # Opened to write (a run dir's store folded again): the column is added, empty.
    writable = stores.Store(path)
    writable.write([LaterStepRecord(**{**earlier[0], "step": 40, "prefetch_ms": 2.0})])
    writable.close()
    reread = stores.Store(path, readonly=True).steps()
    assert [record.prefetch_ms for record in reread] == [1.5] * 40 + [2.0]


def test_a_store_from_a_newer_traceml_is_refused_in_one_line(earlier_run, tmp_path):
    database = sqlite3.connect(earlier_run / "telemetry.sqlite")
    database.execute(f"PRAGMA user_version={stores.STORE_LAYOUT + 1}")
    database.commit()
    database.close()
    (earlier_run / "final_summary.json").unlink()
    for args in (("view", earlier_run, "--port", "0"), ("export", earlier_run, "--format", "csv"),
                 ("compare", earlier_run, EARLIER_RUN)):
        done = traceml(*args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert f"was written by a newer TraceML (store layout {stores.STORE_LAYOUT + 1}" in done.stderr
        assert "upgrade TraceML to open it" in done.stderr
