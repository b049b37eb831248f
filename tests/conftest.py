"""Shared helpers: run real training scripts under TraceML and read back what they left.

scripts/test.sh runs the suite as CI does: the tests not marked `serial` on parallel workers,
then the `serial` ones in a pytest of their own. Most tests are real runs in subprocesses that
wait on sleeps, sockets and each other as much as they compute, and each asks for one core (one
torch thread, set below), so several at once fill a 2-core machine without starving one another;
their assertions leave room for a busy machine. Tests marked `serial` judge the machine's own
timings (runs compared with one another): they run apart from the parallel tests, beside at most
one worker, as they must hold beside one busy core anyway. An
xdist_group would not do for them: it keeps tests on one worker, still beside the other workers.
Groups serve modules whose module-scoped fixture makes an expensive run (a 2-rank run looked at
in a browser): --dist loadgroup gives a group's tests to one worker, which makes the run once,
and spreads every other test one by one.
"""
import ctypes
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sentences import check_summary

# One intra-op thread for torch in every process the suite starts (and in its own): each test
# asks for one core and gets it. torch's default is a thread per core, and two processes each
# spinning two threads on two cores (two workers, or a test beside a busy machine) ran a
# 12000-step loop in 22 s instead of 7, and their timings went with it.
os.environ["OMP_NUM_THREADS"] = "1"

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN_LOOP = SCRIPTS / "train_loop.py"


# On a loaded machine gloo aborts a rank at interpreter exit, after all of its work, about one
# run in a few hundred, with TraceML or without (plain torchrun runs this suite's DDP script
# without traceml to the same abort): its worker threads can still hold tensors while Python
# finalizes (pytorch/pytorch#179291 proposed an atexit fix and was abandoned).
GLOO_EXIT_ABORT = "terminate called without an active exception"


def ended_well(process: "subprocess.CompletedProcess | Run") -> bool:
    """A multi-rank run that exited 0, or whose only fault is gloo's abort at exit (above).
    The tests then judge its figures as for any run: every step is still asserted."""
    return process.returncode == 0 or GLOO_EXIT_ABORT in process.stderr


class Run:
    """A finished subprocess run and its run directory."""

    def __init__(self, process: subprocess.CompletedProcess, run_dir: Path):
        self.process = process
        self.run_dir = run_dir

    @property
    def returncode(self) -> int:
        return self.process.returncode

    @property
    def stdout(self) -> str:
        return self.process.stdout

    @property
    def stderr(self) -> str:
        return self.process.stderr

    def summary(self) -> dict:
        summary = json.loads((self.run_dir / "final_summary.json").read_text())
        check_summary(summary, str(self.run_dir))
        return summary

    def step_rows(self) -> list:
        with sqlite3.connect(self.run_dir / "telemetry.sqlite") as db:
            db.row_factory = sqlite3.Row
            return [dict(row) for row in db.execute("SELECT * FROM steps ORDER BY step")]


# Processes orphaned by a test (a launcher that died before its children) are re-parented to
# this one rather than to init, so that the check below still sees them.
PR_SET_CHILD_SUBREAPER = 36
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Fail a test that leaves a process running, and kill what it left."""
    before = {process.pid for process in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 3.0  # a process being reaped right now is not left behind
    while True:
        left = [process for process in psutil.Process().children(recursive=True)
                if process.pid not in before and _running(process)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    names = []
    for process in left:
        try:
            names.append(f"{process.pid} {' '.join(process.cmdline())[:160]}")
            process.kill()
        except psutil.Error:
            pass
    _reap_orphans(before)
    if left:
        pytest.fail("processes left behind:\n" + "\n".join(names), pytrace=False)


@pytest.fixture(autouse=True)
def every_runs_sentences_checked(request):
    """After each test, the findings of every run it left a summary of in its tmp_path, however it
    was started (the traceml_run fixture, plain python, its own subprocess), must check (sentences.py)."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is not None:
        for summary in sorted(Path(tmp_path).rglob("final_summary.json")):
            if summary.parent not in CHECKED_RUNS:
                _check_sentences(summary.parent)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap_orphans(before: set) -> None:
    """Collect the exit status of orphans that ended here (no Popen of the test waits for them)."""
    if all(process.pid in before for process in psutil.Process().children()):
        return  # nothing new: no pause (most tests, ~25 s over the suite)
    time.sleep(0.05)
    for process in psutil.Process().children():
        if process.pid not in before and not _running(process):
            try:
                os.waitpid(process.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def stored_steps(run_dir: Path) -> int:
    """How many step records the run's store holds now (0 before it has any)."""
    try:
        with sqlite3.connect(f"file:{run_dir / 'telemetry.sqlite'}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    except sqlite3.Error:
        return 0


def _env():
    env = dict(os.environ)
    env.pop("TRACEML_COLLECTOR", None)
    env.pop("TRACEML_RUN_DIR", None)
    return env


def run_traceml(where: Path, *script_args, script=TRAIN_LOOP, run_dir=None, traceml_args=(), timeout=120,
                env=None) -> Run:
    """A real `traceml run` subprocess in the folder `where` (its run directory: where/run).
    The traceml_run fixture's, for a module- or session-scoped fixture to make a run once."""
    run_dir = Path(run_dir) if run_dir is not None else where / "run"
    command = [sys.executable, "-m", "traceml", "run", "--run-dir", str(run_dir), *traceml_args,
               str(script), *map(str, script_args)]
    process = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                             cwd=where, env={**_env(), **(env or {})})
    _check_sentences(run_dir)
    return Run(process, run_dir)


CHECKED_RUNS = set()  # run directories whose sentences were checked as the run ended


def _check_sentences(run_dir: Path) -> None:
    """Every finding of a run that left a summary states figures its evidence gives (sentences.py)."""
    CHECKED_RUNS.add(run_dir)
    try:
        summary = json.loads((run_dir / "final_summary.json").read_text())
    except (OSError, ValueError):
        return  # a run that was to fail, or was stopped, before its summary
    check_summary(summary, str(run_dir))


@pytest.fixture
def traceml_run(tmp_path):
    """traceml_run(script_args..., run_dir=None) -> Run, via a real `traceml run` subprocess."""

    def run(*script_args, **options):
        return run_traceml(tmp_path, *script_args, **options)

    return run


# A wide MLP fed from memory: compute-bound, and healthy. A test in test_end_to_end and one in
# test_memory_gc_spikes read it: both are in this group (one worker), so the run is made once.
# 1024 wide, not wider: at 2048 host RSS wandered by up to 14 MiB over the run (4 at 1024),
# where the healthy run must show no memory creep.
WIDE_MLP = ("--steps", 80, "--no-loader", "--batch-size", 64, "--features", 512, "--width", 1024)
wide_mlp = pytest.mark.xdist_group("wide_mlp")


@pytest.fixture(scope="session")
def wide_mlp_run(tmp_path_factory):
    """train_loop.py with WIDE_MLP's arguments under `traceml run`, made once."""
    return run_traceml(tmp_path_factory.mktemp("wide_mlp"), *WIDE_MLP)


# Two DDP ranks, rank 1 slow on its data, under the deep-dive: the input straggler's test in
# test_distributed and the HTML report's in test_reports read it (one worker, one run).
ddp_input_straggler = pytest.mark.xdist_group("ddp_input_straggler")


@pytest.fixture(scope="session")
def ddp_input_straggler_run(tmp_path_factory):
    """ddp_loop.py on 2 ranks, rank 1 waiting 2 ms a sample for its data, with --deep, made once."""
    return run_traceml(tmp_path_factory.mktemp("ddp_input_straggler"), "--steps", 40, "--slow-rank", 1,
                       "--load-ms", 2, script=SCRIPTS / "ddp_loop.py", traceml_args=("--nproc-per-node", "2", "--deep"))


@pytest.fixture
def plain_run(tmp_path):
    """plain_run(script_args...) -> Run, via plain `python script.py` (no launcher)."""

    def run(*script_args, script=TRAIN_LOOP, timeout=120):
        process = subprocess.run([sys.executable, str(script), *map(str, script_args)],
                                 capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                                 env=_env())
        runs = sorted((tmp_path / "traceml_runs").glob("*")) if (tmp_path / "traceml_runs").exists() else []
        return Run(process, runs[-1] if runs else tmp_path / "traceml_runs" / "missing")

    return run
