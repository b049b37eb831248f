"""The run directory: where a run's files go, created without ever overwriting an earlier run."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Tuple

RUNS_ROOT = "traceml_runs"
STORE_NAME = "telemetry.sqlite"
SUMMARY_JSON = "final_summary.json"
SUMMARY_TXT = "final_summary.txt"
REPORT_HTML = "report.html"


class RunDirError(Exception):
    """A run directory that must not be used (it holds an earlier run)."""


def default_run_dir(script: str, root: str = RUNS_ROOT) -> Path:
    """`./traceml_runs/<timestamp>-<script name>`, with a numeric suffix if that name is taken."""
    stem = Path(script).stem or "run"
    base = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"
    candidate, suffix = base, 2
    while candidate.exists():
        candidate = base.with_name(f"{base.name}-{suffix}")
        suffix += 1
    return candidate


def check_not_taken(run_dir: Path) -> None:
    """Refuse a directory that already holds files: an earlier run is never overwritten."""
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise RunDirError(f"run dir {run_dir} already exists and is not empty; "
                          "choose another --run-dir")


def prepare(run_dir: Path) -> Tuple[Optional[Path], Optional[str]]:
    """Create the directory; (path, None) when writable, else (None, a one-line warning)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".traceml-write-check"
        probe.write_bytes(b"")
        probe.unlink()
        return run_dir, None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return None, (f"traceml: cannot write run dir {run_dir} ({reason}); the run goes on and "
                      "the summary is printed but not saved")


def store_path(run_dir: Optional[Path]) -> str:
    return os.fspath(run_dir / STORE_NAME) if run_dir is not None else ":memory:"
