"""The fault matrix: whatever breaks around it, the training's exit code and output are its own,
TraceML says so in one line, what it recorded is kept, and no process is left behind."""
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TRAIN_LOOP, _env, stored_steps


def wait_for(predicate, timeout_s=60.0, every_s=0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("timed out")


def run_json(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_run_json_says_where_the_collector_is_then_how_it_ended(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir",
                                str(run_dir), str(TRAIN_LOOP), "--steps", "150", "--load-ms", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    live = wait_for(lambda: run_json(run_dir).get("status") == "running" and run_json(run_dir))
    host, _, port = live["collector"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert live["pids"]["launcher"] == process.pid and live["pids"]["script"] > 0
    socket.create_connection((host, int(port)), timeout=2).close()  # it is really there
    process.communicate(timeout=120)
    done = run_json(run_dir)
    assert done["status"] == "finished" and done["exit_code"] == 0 == process.returncode
    assert done["ended_at"] >= done["started_at"] and done["rank_pids"] == [live["pids"]["script"]]


def test_killing_the_collector_leaves_training_alone_and_the_rank_keeps_its_summary(tmp_path):
    # Plain python: rank 0 starts the collector as a child; kill it mid-run. 5 ms a sample keeps
    # the loop input-bound beside a CPU hog too, which slows this tiny model's backward many-fold.
    process = subprocess.Popen([sys.executable, str(TRAIN_LOOP), "--steps", "200", "--load-ms", "5"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               env=_env(), start_new_session=True)
    runs = tmp_path / "traceml_runs"
    run_dir = wait_for(lambda: next(iter(runs.glob("*-train_loop")), None) if runs.exists() else None)
    wait_for(lambda: stored_steps(run_dir) >= 40)
    collector_pid = run_json(run_dir)["pids"]["collector"]
    os.kill(collector_pid, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0
    assert "trained 200 steps" in stdout  # the script's output, untouched
    assert "the collector was lost; rank 0's summary is in" in stderr
    local = json.loads((run_dir / "rank0-local-summary.json").read_text())
    assert local["traceml/steps"] >= 100 and local["exit_code"] == 0
    assert local["traceml/diagnosis/primary"] == "INPUT_BOUND"
    assert stored_steps(run_dir) >= 40  # what the collector had committed is still there
    assert group_is_gone(process.pid)


@pytest.mark.parametrize("mode", ["traceml run", "plain python"])
def test_sigterm_to_the_process_group_keeps_the_run(tmp_path, mode):
    run_dir = tmp_path / "run"
    command = ([sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", str(run_dir)]
               if mode == "traceml run" else [sys.executable])
    env = {**_env(), "TRACEML_RUN_DIR": str(run_dir)}
    process = subprocess.Popen([*command, str(TRAIN_LOOP), "--steps", "3000", "--load-ms", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               env=env, start_new_session=True)
    wait_for(lambda: stored_steps(run_dir) >= 30)
    os.killpg(process.pid, signal.SIGTERM)  # a job's time limit: the whole group at once
    stdout, stderr = process.communicate(timeout=120)
    expected = 128 + signal.SIGTERM if mode == "traceml run" else -signal.SIGTERM
    assert process.returncode == expected
    summary = wait_for(lambda: (run_dir / "final_summary.json").is_file()
                       and json.loads((run_dir / "final_summary.json").read_text()), timeout_s=30)
    assert summary["steps"]["count"] >= 30
    assert summary["run"]["exit_code"] == 128 + signal.SIGTERM
    assert summary["steps"]["count"] >= stored_steps(run_dir) - 1
    assert "Traceback" not in stderr
    wait_for(lambda: group_is_gone(process.pid), timeout_s=30)


def test_a_script_closing_its_stdout_keeps_its_run(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.run([sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir",
                              str(run_dir), str(TRAIN_LOOP), "--steps", "40", "--close-stdout-at", "10"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env())
    assert process.returncode == 0, process.stderr
    assert "closing stdout" in process.stdout and "trained" not in process.stdout
    assert json.loads((run_dir / "final_summary.json").read_text())["steps"]["count"] == 40


def test_a_taken_collector_port_is_one_clear_line(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    master_port = taken.getsockname()[1] - 1  # the collector takes MASTER_PORT + 1
    try:
        process = subprocess.run(
            [sys.executable, "-m", "traceml", "run", "--nnodes", "2", "--node-rank", "0",
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
             "--run-dir", str(tmp_path / "run"), str(TRAIN_LOOP)],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**_env(), "TRACEML_TOKEN": "s3cret"})
    finally:
        taken.close()
    assert process.returncode == 2
    assert process.stderr.startswith(f"traceml: cannot listen on 127.0.0.1:{master_port + 1}")
    assert process.stderr.count("\n") == 1 and "Traceback" not in process.stderr


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs of its own: the run dir fills up mid-run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_full_disk_costs_telemetry_not_the_training(tiny_disk, tmp_path):
    run_dir = tiny_disk / "run"
    process = subprocess.run([sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir",
                              str(run_dir), str(TRAIN_LOOP), "--steps", "5000", "--no-loader"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env())
    assert process.returncode == 0
    assert "trained 5000 steps" in process.stdout and "TraceML" in process.stdout  # the card still shows
    store_lines = [line for line in process.stderr.splitlines() if "could not store" in line]
    assert len(store_lines) == 1, process.stderr  # said once, not once per frame
    assert "records did not fit" in store_lines[0]
    assert "Traceback" not in process.stderr
    # What fit is kept: the store filled the disk whatever its commits' sizes, and the room held
    # back from the start still took the summary files.
    kept = stored_steps(run_dir)
    assert kept < 5000
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["steps"]["count"] == kept
    assert "TraceML" in (run_dir / "final_summary.txt").read_text()
    assert not (run_dir / ".traceml-reserve").exists()
    # ~250 bytes a step here: the records, not old copies of pages, fill the disk (about 2400
    # steps in 600 KiB of the 1 MiB, beside the room held for the summary and the log's fold;
    # 1444 once in a fresh-clone run of the suite). Old copies of pages kept 60 steps. 5000
    # steps would take twice the disk: it is full well before the end.
    assert kept > 1000 and (run_dir / "telemetry.sqlite").stat().st_size > 300 * 1024


@pytest.mark.parametrize("commit_every", [1, 50, None])
def test_a_full_store_keeps_every_chunk_that_fits_whatever_the_commits(tiny_disk, commit_every):
    """One commit of everything, or many small ones: the same records fit on the same disk."""
    from test_records import step
    from traceml.collector.store import Store, StoreFull

    store = Store(str(tiny_disk / "telemetry.sqlite"))
    failures = 0
    for index in range(0, 20000, 20):
        try:
            store.write([step(n) for n in range(index, index + 20)])
        except sqlite3.Error:
            failures += 1
        if commit_every and (index // 20) % commit_every == 0:
            try:
                store.commit()
            except StoreFull:
                failures += 1
    try:
        store.close()
    except StoreFull:
        failures += 1
    assert failures > 0  # the disk did fill
    kept = stored_steps(tiny_disk)
    # ~75 bytes a step: most of the 1 MiB holds records, not copies of pages.
    assert 7000 < kept < 20000, kept
