"""torch.distributed.run's agent as `traceml run` starts it: the same agent, which also writes how
each failed rank ended, for the run's summary.

A rank that is killed (SIGKILL from the kernel's out-of-memory killer or a scheduler) or that
crashes in native code says no goodbye, and only its parent, the agent, learns its exit status.
torch.distributed.run raises ChildFailedError with every failed rank's status; this module runs
its `main` unchanged and, on that error, writes them as JSON to the file that ENV_EXITS_FILE
names, then lets the error go on, so the agent's output and exit code are torch's own.
"""
from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Dict, List

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

ENV_EXITS_FILE = "TRACEML_RANK_EXITS_FILE"


def main(argv: List[str]) -> None:
    exits_file = os.environ.pop(ENV_EXITS_FILE, None)  # the ranks' environment stays the user's
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as failed:
        if exits_file:
            write_exits(exits_file, failed.failures)
        raise


def write_exits(path: str, failures: Dict[int, ProcessFailure]) -> None:
    """Each failed rank's exit status (negative: the signal that killed it) and pid, by global rank."""
    exits = {str(rank): {"exit_code": int(failure.exitcode), "pid": int(failure.pid)}
             for rank, failure in failures.items()}
    try:
        with open(path, "w") as out:
            json.dump(exits, out)
    except OSError as exc:  # the summary goes without them
        print(f"traceml: could not record the ranks' exit status: {exc}", file=sys.stderr)


def read_exits(path: str) -> Dict[int, Dict[str, int]]:
    """What write_exits wrote (nothing when no rank failed), the file then removed."""
    try:
        with open(path) as source:
            exits = json.load(source)
        os.unlink(path)
    except (OSError, ValueError):
        return {}
    return {int(rank): status for rank, status in exits.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
