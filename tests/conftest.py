"""Shared helpers: run real training scripts under TraceML and read back what they left."""
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN_LOOP = SCRIPTS / "train_loop.py"


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
        return json.loads((self.run_dir / "final_summary.json").read_text())

    def step_rows(self) -> list:
        with sqlite3.connect(self.run_dir / "telemetry.sqlite") as db:
            db.row_factory = sqlite3.Row
            return [dict(row) for row in db.execute("SELECT * FROM steps ORDER BY step")]


def _env():
    env = dict(os.environ)
    env.pop("TRACEML_COLLECTOR", None)
    env.pop("TRACEML_RUN_DIR", None)
    return env


@pytest.fixture
def traceml_run(tmp_path):
    """traceml_run(script_args..., run_dir=None) -> Run, via a real `traceml run` subprocess."""

    def run(*script_args, script=TRAIN_LOOP, run_dir=None, traceml_args=(), timeout=120):
        run_dir = Path(run_dir) if run_dir is not None else tmp_path / "run"
        command = [sys.executable, "-m", "traceml", "run", "--run-dir", str(run_dir), *traceml_args,
                   str(script), *map(str, script_args)]
        process = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                 cwd=tmp_path, env=_env())
        return Run(process, run_dir)

    return run


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
