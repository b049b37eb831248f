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
RUN_JSON = "run.json"
# Room held on the run's disk from the start, given back at the end: however full the store
# makes the disk, final_summary.json and final_summary.txt (a few KiB each) still fit.
RESERVE_NAME = ".traceml-reserve"
RESERVE_BYTES = 128 * 1024


class RunDirError(Exception):
    """A run directory that must not be used (it holds an earlier run), or that holds no run."""


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


def finished_store(run_dir: Path) -> Path:
    """The store of a run directory written earlier; RunDirError, with the one line to say,
    when the path is missing, not a directory, or holds no store."""
    if not run_dir.exists():
        raise RunDirError(f"no such run directory: {run_dir}")
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a run directory")
    store = run_dir / STORE_NAME
    if not store.is_file():
        raise RunDirError(f"{run_dir} is not a TraceML run directory: it holds no {STORE_NAME}")
    return store


def prepare(run_dir: Path) -> Tuple[Optional[Path], Optional[str]]:
    """Create the directory; (path, None) when writable, else (None, a one-line warning)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".traceml-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return None, (f"traceml: cannot write run dir {run_dir} ({reason}); the run goes on and "
                      "the summary is printed but not saved")
    hold_room(run_dir / RESERVE_NAME, RESERVE_BYTES)
    return run_dir, None


def hold_room(path: Path, size_bytes: int) -> bool:
    """Take size_bytes of the disk now, as a file, to give back when it fills (give_room_back):
    False when there is not even that room (nothing is held then)."""
    try:
        path.write_bytes(b"\0" * size_bytes)
        return True
    except OSError:
        give_room_back(path)
        return False


def give_room_back(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def release_reserve(run_dir: Path) -> None:
    """Give back the room held for the summary files (see RESERVE_BYTES)."""
    give_room_back(run_dir / RESERVE_NAME)


def store_path(run_dir: Optional[Path]) -> str:
    return os.fspath(run_dir / STORE_NAME) if run_dir is not None else ":memory:"


def update_run_json(run_dir: Optional[Path], values: dict) -> None:
    """Merge values into the run's run.json (where its collector listens, its pids, its start;
    at the end its exit code and end). Written whole to a temporary file and renamed, so a
    reader never sees half of it. A run dir that cannot be written has none."""
    if run_dir is None:
        return
    import json  # here, not above: `traceml run` starts the script before it needs json

    path = run_dir / RUN_JSON
    try:
        current = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        current = {}
    current.update(values)
    partial = path.with_suffix(".json.partial")
    try:
        partial.write_text(json.dumps(current, indent=2) + "\n")
        os.replace(partial, path)
    except OSError:
        pass


def iso_time(unix_s: float) -> str:
    """A moment as run.json and final_summary.json write it: ISO 8601, UTC, to the second."""
    import datetime

    return datetime.datetime.fromtimestamp(unix_s, tz=datetime.timezone.utc).isoformat(timespec="seconds")
