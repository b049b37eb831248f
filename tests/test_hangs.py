"""The hang locator: a rank that ends no step is named with its line within seconds, live (stderr,
/metrics) and in the summary the run ends with; planned work and a slow step are no hang."""
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from conftest import SCRIPTS, _env

from traceml.diagnose.hangs import HANG_AFTER_S, RankProgress, allowance_s, find_hang
from traceml.records import RankPulse

HANG_LOOP = SCRIPTS / "hang_loop.py"


# -- the rule, on what the collector would hold --------------------------------------------------
def progress(rank, steps=20, stalled_s=0.0, pulse=None, now=1000.0, **kwargs):
    return RankProgress(rank=rank, pid=100 + rank, host="elsewhere", steps_ended=steps,
                        last_progress_unix_s=now - stalled_s, median_step_ms=10.0,
                        last_heard_unix_s=now - 1.0, pulse=pulse, **kwargs)


def pulse(rank, stalled_s, steps=20, phase="backward", waiting_in="", stack=(("/home/me/train.py", 42, "load"),),
          now=1000.0):
    return RankPulse(rank=rank, unix_s=now - 1.0, steps_ended=steps, since_progress_s=stalled_s - 1.0,
                     phase=phase, stack=list(stack), innermost="time.py:1 sleep", waiting_in=waiting_in, pid=100 + rank)


def test_the_rank_in_its_own_code_is_named_and_the_waiting_one_told_apart():
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce",
                                                                 stack=[("/home/me/train.py", 50, "main")])),
                      progress(1, stalled_s=40, pulse=pulse(1, 40, phase="in step"))], 1000.0)
    assert hang.finding.kind == "HANG" and hang.finding.rank == 1 and hang.stalled_ranks == [0, 1]
    assert "rank 1 is in its own code at train.py:42 load" in hang.finding.summary
    assert "rank 0 waits in all_reduce from backward at train.py:50 main for 40 s" in hang.finding.summary
    assert "py-spy dump --pid 101" in hang.finding.action


def test_within_the_allowance_evaluation_and_a_first_step_are_no_hang():
    assert find_hang([progress(0, stalled_s=HANG_AFTER_S - 1)], 1000.0) is None
    assert find_hang([progress(0, stalled_s=60, pulse=pulse(0, 60, phase="evaluation"))], 1000.0) is None
    assert find_hang([progress(0, stalled_s=60, pulse=pulse(0, 60, phase="checkpoint"))], 1000.0) is None
    assert find_hang([progress(0, steps=0, stalled_s=300)], 1000.0) is None  # loading, a first compile
    slow = progress(0, stalled_s=60)
    slow.median_step_ms = 8000.0  # 8 s steps: 80 s allowed
    assert allowance_s(slow, HANG_AFTER_S) == 80.0 and find_hang([slow], 1000.0) is None


def test_a_gone_rank_and_a_frozen_one_are_said_so():
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce")),
                      progress(1, stalled_s=40, gone=True)], 1000.0)
    assert hang.finding.rank == 1 and "rank 1 is gone (pid 101" in hang.finding.summary
    frozen = progress(1, stalled_s=40)
    frozen.last_heard_unix_s = 1000.0 - 30
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce")), frozen], 1000.0)
    assert "rank 1 no longer answers (pid 101" in hang.finding.summary


def test_every_rank_in_a_collective_is_a_mismatch():
    hang = find_hang([progress(r, stalled_s=40, pulse=pulse(r, 40, waiting_in="all_reduce")) for r in (0, 1)],
                     1000.0)
    assert hang.finding.rank is None and "called different ones" in hang.finding.summary
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in hang.finding.action


def test_the_pulse_comes_only_while_no_step_ends_and_reads_the_stack():
    import threading
    import types

    from traceml.probe import pulse as pulses

    clock = [0.0]
    probe = types.SimpleNamespace(step_index=3, in_step=1, open_phase=-1, in_evaluation=False)
    watch = pulses.PulseWatch(0, probe, threading.get_ident(), clock=lambda: clock[0])
    assert watch.due() is None  # the first look: the count is new
    clock[0] = pulses.PULSE_AFTER_S - 0.1
    assert watch.due() is None
    clock[0] = pulses.PULSE_AFTER_S + 0.1
    sent = watch.due()
    assert sent.steps_ended == 3 and sent.since_progress_s == pytest.approx(pulses.PULSE_AFTER_S + 0.1)
    # Read from this thread: TraceML's own frames left out, this test is the innermost user frame.
    assert sent.stack[0][2] == "test_the_pulse_comes_only_while_no_step_ends_and_reads_the_stack"
    assert sent.innermost.startswith("pulse.py:") and sent.phase == "in step"
    assert watch.due() is None  # not again before PULSE_EVERY_S
    probe.step_index = 4
    clock[0] += pulses.PULSE_EVERY_S
    assert watch.due() is None  # a step ended: quiet again
    site = "/usr/lib/python3/site-packages/torch"
    assert pulses._read([(f"{site}/distributed/distributed_c10d.py", 1, "all_reduce"),
                         ("/home/me/train.py", 9, "main")]) == ("all_reduce", "")
    assert pulses._read([(f"{site}/serialization.py", 1, "save"), ("/home/me/train.py", 9, "main")]) == ("", "checkpoint")
    assert pulses._read([(f"{site}/_dynamo/eval_frame.py", 1, "_fn")]) == ("", "compile")
    assert pulses._read([(f"{site}/utils/data/dataloader.py", 1, "_next_data")]) == ("DataLoader", "")


# -- real runs ------------------------------------------------------------------------------------
class Launched:
    """`traceml run` in the background, its stderr read as it comes."""

    def __init__(self, tmp_path, *script_args, traceml_args=()):
        self.run_dir = tmp_path / "run"
        command = [sys.executable, "-m", "traceml", "run", "--run-dir", str(self.run_dir), "--mode", "summary",
                   *traceml_args, str(HANG_LOOP), *map(str, script_args)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        cwd=tmp_path, env=_env())
        self.stderr_lines = []
        self.stdout = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.stderr_lines.append(line)

    def wait_for(self, text, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in self.stderr_lines if text in line]
            if found:
                return found[0]
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        return None

    def stop(self, timeout_s=60):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.stdout, _ = self.process.communicate(timeout=timeout_s)
        self._reader.join(timeout=5)
        return self.process.returncode

    def summary(self):
        return json.loads((self.run_dir / "final_summary.json").read_text())


def test_a_rank_in_its_own_code_is_named_with_its_line_and_the_run_keeps_the_hang(tmp_path):
    run = Launched(tmp_path, "--stall-rank", 1, "--at", 15, traceml_args=(
        "--nproc-per-node", "2", "--hang-after", "5", "--on-alert", f"cat >> {tmp_path / 'alerts.jsonl'}"))
    try:
        started = time.monotonic()
        line = run.wait_for("traceml: HANG", timeout_s=90)
        assert line is not None, "".join(run.stderr_lines)[-3000:]
        assert time.monotonic() - started < 90
        assert "rank 1 is in its own code at hang_loop.py" in line and "load_shard" in line
        assert "rank 0 waits in all_reduce" in line
        alerts_file = tmp_path / "alerts.jsonl"
        deadline = time.monotonic() + 15  # the alert thread looks every 2 s
        while time.monotonic() < deadline and '"HANG"' not in (alerts_file.read_text() if alerts_file.exists() else ""):
            time.sleep(0.2)
        time.sleep(4)  # two more looks: the same hang must not be sent again
    finally:
        returncode = run.stop()
    assert returncode != 0  # stopped by SIGTERM, as without TraceML
    summary = run.summary()
    assert summary["primary_diagnosis"]["kind"] == "HANG" and summary["primary_diagnosis"]["rank"] == 1
    places = {place["rank"]: place for place in summary["hang"]["ranks"]}
    assert places[1]["state"] == "own code" and places[1]["last_step"] == 14
    assert any("hang_loop.py" in frame and "load_shard" in frame for frame in places[1]["stack"])
    assert places[0]["state"] == "collective" and places[0]["waiting_in"] == "all_reduce"
    assert "Hang" in run.stdout.splitlines()[2]  # among the card's first lines
    # --on-alert: one JSON document for the hang, however many checks saw it.
    alerts = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    hangs = [alert for alert in alerts if alert["kind"] == "HANG"]
    assert len(hangs) == 1 and hangs[0]["rank"] == 1 and hangs[0]["script"] == "hang_loop.py"
    assert len({(alert["kind"], alert["rank"]) for alert in alerts}) == len(alerts)


def test_one_process_stuck_in_its_dataloader_is_named_live_on_metrics(tmp_path):
    port = _free_port()
    run = Launched(tmp_path, "--hang-worker-rank", 0, "--at", 10, "--zero-code",
                   traceml_args=("--hang-after", "5", "--metrics-port", str(port), "--on-alert", "sleep 60"))
    try:
        line = run.wait_for("traceml: HANG", timeout_s=90)
        assert line is not None, "".join(run.stderr_lines)[-3000:]
        assert "rank 0 is in a DataLoader wait at hang_loop.py" in line
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'traceml_stalled{rank="0"} 1.0' in metrics
        # The alert command that never ends is stopped after its 10 s; the run goes on.
        assert run.wait_for("ran past 10 s for HANG and was stopped", timeout_s=30) is not None
        assert run.process.poll() is None
    finally:
        run.stop()
    assert run.summary()["hang"]["stalled_ranks"] == [0]


def test_evaluation_on_every_rank_and_a_slow_step_that_ends_raise_none(traceml_run, tmp_path):
    run = traceml_run("--eval-s", 12, "--at", 10, "--steps", 30, script=HANG_LOOP,
                      traceml_args=("--nproc-per-node", "2", "--hang-after", "3", "--mode", "summary"), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "HANG" not in run.stderr
    summary = run.summary()
    assert summary["hang"] is None and all(f["kind"] != "HANG" for f in summary["findings"])
    # A single slow step that ends: rank 1's 6 s, 300 of its median steps but under the 10 s allowed.
    run = traceml_run("--stall-rank", 1, "--stall-s", 6, "--at", 10, "--steps", 30, script=HANG_LOOP,
                      run_dir=tmp_path / "slow_step",
                      traceml_args=("--nproc-per-node", "2", "--hang-after", "10", "--mode", "summary"), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "HANG" not in run.stderr
    assert run.summary()["hang"] is None and run.summary()["primary_diagnosis"]["kind"] != "HANG"


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
