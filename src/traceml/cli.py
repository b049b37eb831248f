"""The `traceml` command: launch a script under a collector, and finish the run into its directory.

`traceml run` hosts the collector in its own process, runs the script with the same Python,
waits for it, then writes the run directory and prints the card. Without `traceml run`, the
probe in rank 0 starts `python -m traceml _collect`, which does the same from the other side.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Set, Tuple

log = logging.getLogger("traceml")

ENV_COLLECTOR = "TRACEML_COLLECTOR"
ENV_RUN_DIR = "TRACEML_RUN_DIR"
RANK_GOODBYE_TIMEOUT_S = 5.0


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args)
    if args.command == "_collect":
        return collect_command(args)
    parser.print_help()
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="traceml", description="Always-on observability for "
                                     "PyTorch training: where each step's time and memory go.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="run a training script under TraceML",
                              description="Run SCRIPT with the same Python under a collector; "
                                          "print the card and write the run directory at the end.")
    run.add_argument("--mode", choices=("cli", "summary"), default=None,
                     help="cli on a terminal, summary otherwise (default: chosen from stdout)")
    run.add_argument("--run-dir", type=Path, default=None,
                     help="where the run's files go (default ./traceml_runs/<time>-<script>)")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    collect = commands.add_parser("_collect", help=argparse.SUPPRESS)
    collect.add_argument("--ready-fd", type=int, required=True)
    collect.add_argument("--parent-pid", type=int, required=True)
    collect.add_argument("--script", required=True)
    return parser


def _fail(message: str, code: int = 2) -> int:
    print(f"traceml: {message}", file=sys.stderr)
    return code


# -- traceml run --------------------------------------------------------------------------------
def run_command(args: argparse.Namespace) -> int:
    from traceml import rundir

    script = Path(args.script)
    if not script.is_file():
        return _fail(f"no such script: {args.script}")
    if args.run_dir is not None:
        try:
            rundir.check_not_taken(args.run_dir)
        except rundir.RunDirError as exc:
            return _fail(str(exc))
        run_dir = args.run_dir
    else:
        run_dir = rundir.default_run_dir(script.name)

    from traceml.collector.server import Collector
    from traceml.collector.store import Store
    from traceml.collector.system import SystemSampler

    writable_dir, warning = rundir.prepare(run_dir)
    if warning:
        print(warning, file=sys.stderr)
    store = Store(rundir.store_path(writable_dir))
    collector = Collector(store)
    address = collector.start()
    child_pids: Set[int] = set()
    sampler = SystemSampler(collector.ingest, lambda: child_pids | collector.training_pids)

    env = dict(os.environ)
    env[ENV_COLLECTOR] = address
    env[ENV_RUN_DIR] = os.fspath(run_dir)
    started = time.time()
    try:
        child = subprocess.Popen([sys.executable, os.fspath(script), *args.script_args], env=env)
    except OSError as exc:
        collector.stop()
        return _fail(f"cannot start {script}: {exc}")
    child_pids.add(child.pid)
    sampler.start()
    restore = _forward_signals(child)
    try:
        returncode = child.wait()
    finally:
        restore()
    ended = time.time()
    exit_code = 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128+N

    collector.wait_for_ranks(timeout_s=RANK_GOODBYE_TIMEOUT_S)
    sampler.stop()
    collector.stop()
    from traceml.views.summary import RunFacts

    facts = RunFacts(script=script.name, argv=[os.fspath(script), *args.script_args],
                     exit_code=exit_code, started_at_unix_s=started, ended_at_unix_s=ended)
    finish_run(store, writable_dir, facts)
    return exit_code


def _forward_signals(child: subprocess.Popen) -> Callable[[], None]:
    """Pass Ctrl-C and SIGTERM on to the script, and outlive them to write the summary.

    A Ctrl-C typed at the terminal already reaches the script, which shares our process group;
    forwarding it too would interrupt the script's own clean-up. So SIGINT is forwarded only
    when it cannot have come from our terminal (no terminal, or we are not in the foreground).
    """

    def from_terminal() -> bool:
        try:
            return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
        except (OSError, ValueError, AttributeError):
            return False

    def on_signal(signum: int, frame: Any) -> None:
        if child.poll() is not None:
            return
        if signum == signal.SIGINT and from_terminal():
            return
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


# -- python train.py: the collector process rank 0 starts -------------------------------------
def spawn_collector_process(hello: Any) -> Tuple[subprocess.Popen, str]:
    """Start `python -m traceml _collect` for this run and return it with its address."""
    read_fd, write_fd = os.pipe()
    script = hello.argv[0] if hello.argv else "python"
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "traceml", "_collect", "--ready-fd", str(write_fd),
             "--parent-pid", str(os.getpid()), "--script", script],
            pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        readable, _, _ = select.select([ready], [], [], 20.0)
        line = ready.readline().decode().strip() if readable else ""
    if not line:
        process.kill()
        raise RuntimeError("the collector did not start")
    return process, line


def collect_command(args: argparse.Namespace) -> int:
    # Ctrl-C reaches the whole process group: the collector must outlive it to write the summary.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from traceml import rundir
    from traceml.collector.server import Collector
    from traceml.collector.store import Store
    from traceml.collector.system import SystemSampler

    run_dir = Path(os.environ.get(ENV_RUN_DIR) or rundir.default_run_dir(args.script))
    writable_dir, warning = rundir.prepare(run_dir)
    if warning:
        print(warning, file=sys.stderr)
    store = Store(rundir.store_path(writable_dir))
    collector = Collector(store)
    try:
        address = collector.start()
        os.write(args.ready_fd, f"{address}\n".encode())
    finally:
        os.close(args.ready_fd)
    sampler = SystemSampler(collector.ingest, lambda: collector.training_pids)
    sampler.start()
    parent_gone = lambda: not _alive(args.parent_pid)  # noqa: E731
    while not collector.wait_for_ranks(timeout_s=3600.0, until=parent_gone):
        if parent_gone():
            break
    sampler.stop()
    collector.stop()
    from traceml.views.summary import RunFacts

    hellos, ends = store.hellos(), store.ends()
    rank0 = next((h for h in hellos if h.rank == 0), hellos[0] if hellos else None)
    end0 = next((e for e in ends if e.rank == 0), None)
    argv = rank0.argv if rank0 is not None else [args.script]
    facts = RunFacts(script=Path(argv[0]).name, argv=argv,
                     exit_code=end0.exit_code if end0 is not None else None,
                     started_at_unix_s=rank0.started_at_unix_s if rank0 is not None else time.time(),
                     ended_at_unix_s=time.time())
    finish_run(store, writable_dir, facts)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- the end of every run -----------------------------------------------------------------------
def finish_run(store: Any, run_dir: Optional[Path], facts: Any) -> Optional[dict]:
    """Summarize the store, write the run directory, print the card. Never raises."""
    from traceml import rundir
    from traceml.views.report import render_report
    from traceml.views.summary import RunData, build_summary, card_text, print_card

    try:
        data = RunData(store)
        summary = build_summary(data, facts)
        store.set_meta({"run": summary["run"], "steps": summary["steps"]})
        store.close()
    except Exception as exc:
        print(f"traceml: could not summarize the run: {exc}", file=sys.stderr)
        log.debug("summary failed", exc_info=True)
        return None
    try:
        sys.stdout.flush()
        print_card(summary)
    except Exception as exc:  # a closed stdout must not cost the files
        log.debug("could not print the card: %s", exc)
    if run_dir is not None:
        try:
            (run_dir / rundir.SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
            (run_dir / rundir.SUMMARY_TXT).write_text(card_text(summary))
            (run_dir / rundir.REPORT_HTML).write_text(render_report(summary, data.rolled))
            print(f"traceml: run saved to {run_dir}", file=sys.stderr)
        except OSError as exc:
            print(f"traceml: could not write the run dir {run_dir}: {exc}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    sys.exit(main())
