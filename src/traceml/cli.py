"""The `traceml` command line: parse the arguments and hand each command to the module that does it.

`traceml run` goes to lifecycle.run_script (the run's collector side) and launcher.py (the
script's processes); `_collect`, the collector rank 0 of a plain `python train.py` starts,
to lifecycle.host_collector; view, compare and export to their views.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

from traceml.launcher import DEFAULT_RDZV_TIMEOUT_S, Launch, run_without_collector
from traceml.lifecycle import fail as _fail
from traceml.lifecycle import say as _say


DEFAULT_WEB_PORT = 8765


def entry() -> None:
    """The `traceml` command: main, then out at once. By then the run's files are written and
    closed and no thread has work left; unloading the modules the summary used would only add
    ~30 ms to every `traceml run`."""
    exit_code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: nothing more can be said
            pass
    os._exit(exit_code if isinstance(exit_code, int) else 1)


def main(argv: Optional[List[str]] = None) -> int:
    # No logging.basicConfig: its handler would be the script's too once `traceml run` forks
    # it (launcher.ScriptFork), and the script's own basicConfig would then do nothing.
    # Unconfigured, logging prints warnings as "%(message)s" on stderr all the same.
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args)
    if args.command == "view":
        return view_command(args)
    if args.command == "compare":
        return compare_command(args)
    if args.command == "export":
        return export_command(args)
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
    run.add_argument("--mode", choices=("cli", "dashboard", "summary"), default=None,
                     help="cli: live terminal dashboard; dashboard: live web dashboard; summary: "
                          "the card at the end only (default: cli on a terminal, else summary)")
    run.add_argument("--run-dir", type=Path, default=None,
                     help="where the run's files go (default ./traceml_runs/<time>-<script>)")
    run.add_argument("--deep", action="store_true",
                     help="deep-dive: per-layer time and memory of the model given to trace_step, "
                          "measured every 10th step")
    run.add_argument("--no-auto-capture", dest="auto_capture", action="store_false",
                     help="do not sample a few steps in deep-dive on their own when a step spikes, "
                          "steps slow down against the run's start, or memory jumps")
    run.add_argument("--hang-after", type=_seconds, default=None, metavar="S",
                     help="a rank that ends no step for S seconds (or 10 of its median steps, when "
                          "longer) is stalled: the HANG finding names it and its line (default 30; "
                          "600 before a rank's first step)")
    run.add_argument("--on-alert", default=None, metavar="CMD",
                     help="run the shell command CMD once for each new warn or crit finding (a hang, a "
                          "straggler, memory running out), with the finding as JSON on its standard "
                          "input; CMD gets 10 s")
    _web_arguments(run)
    _distributed_arguments(run)
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    view = commands.add_parser("view", help="reopen a finished run in the web dashboard",
                               description="Serve a run directory's telemetry.sqlite in the web "
                                           "dashboard (read-only) until Ctrl-C.")
    view.add_argument("run_dir", type=Path, help="the run's directory (holds telemetry.sqlite)")
    _web_arguments(view)
    _other_commands(commands)
    return parser


def _distributed_arguments(run: argparse.ArgumentParser) -> None:
    distributed = run.add_argument_group("distributed (launched through torch.distributed.run)")
    distributed.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                             help="ranks on this node")
    distributed.add_argument("--nnodes", type=int, default=1, metavar="M")
    distributed.add_argument("--node-rank", type=int, default=0, metavar="R")
    distributed.add_argument("--master-addr", default=None, metavar="A",
                             help="node 0's address (default 127.0.0.1)")
    distributed.add_argument("--master-port", type=int, default=None, metavar="P",
                             help="the rendezvous port (default 29500); the collector takes P+1 "
                                  "across nodes")
    distributed.add_argument("--rdzv-backend", choices=("static", "c10d"), default="static",
                             help="static: node ranks as given, node 0 hosts the rendezvous; c10d: "
                                  "the rendezvous at --rdzv-endpoint (default static)")
    distributed.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                             help="the rendezvous address (instead of --master-addr/--master-port)")
    distributed.add_argument("--rdzv-conf", default=None, metavar="K=V,...",
                             help="more rendezvous settings, passed to torch.distributed.run")
    distributed.add_argument("--rdzv-timeout", type=int, default=DEFAULT_RDZV_TIMEOUT_S, metavar="S",
                             help="how long every node has to join the rendezvous before the run "
                                  f"gives up (default {DEFAULT_RDZV_TIMEOUT_S})")


def _other_commands(commands: "argparse._SubParsersAction") -> None:
    compare = commands.add_parser("compare", help="did my change help? two runs, phase by phase",
                                  description="Compare two runs (run directories or "
                                              "final_summary.json files): medians per phase with "
                                              "bootstrap intervals, a verdict, the change in "
                                              "diagnosis and the environment.")
    compare.add_argument("run_a", type=Path, help="the baseline run")
    compare.add_argument("run_b", type=Path, help="the changed run")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")

    export = commands.add_parser("export", help="a run's records as a Perfetto trace, JSON lines or CSV")
    export.add_argument("run_dir", type=Path)
    export.add_argument("--format", choices=("chrome", "jsonl", "csv"), required=True)
    export.add_argument("--steps", default=None, metavar="A:B",
                        help="only steps A to B, inclusive (either side may be left out)")
    export.add_argument("--out", default=None, metavar="FILE",
                        help="where to write ('-' for stdout; default: a file in the run dir)")

    collect = commands.add_parser("_collect")  # internal: no help, so not listed
    collect.add_argument("--ready-fd", type=int, required=True)
    collect.add_argument("--parent-pid", type=int, required=True)
    collect.add_argument("--script", required=True)
    collect.add_argument("--host", default="127.0.0.1")
    collect.add_argument("--port", type=int, default=0)
    collect.add_argument("--web-port", type=int, default=None)
    collect.add_argument("--web-host", default="127.0.0.1")


def _web_arguments(parser: argparse.ArgumentParser) -> None:
    web = parser.add_argument_group("web dashboard")
    web.add_argument("--port", type=_port, default=DEFAULT_WEB_PORT, metavar="P",
                     help=f"the dashboard's port; the next free one if taken (default {DEFAULT_WEB_PORT})")
    web.add_argument("--host", default="127.0.0.1", metavar="H",
                     help="the address to serve on (default 127.0.0.1: this machine only)")
    if parser.prog.endswith(" run"):
        web.add_argument("--metrics-port", type=_port, default=None, metavar="P",
                         help="serve Prometheus /metrics on P while the run trains (any mode; "
                              "the dashboard serves /metrics too)")


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not seconds >= 1.0:
        raise argparse.ArgumentTypeError(f"{text} s is too short: at least 1")
    return seconds


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range (0-65535)")
    return port


# -- traceml run --------------------------------------------------------------------------------
def run_command(args: argparse.Namespace) -> int:
    from traceml import lifecycle, rendezvous, rundir

    if not Path(args.script).is_file():
        return _fail(f"no such script: {args.script}")
    if args.hang_after is not None:  # the collector's hang watch reads it (diagnose/hangs.py)
        os.environ["TRACEML_HANG_AFTER_S"] = f"{args.hang_after:g}"
    try:
        launch = Launch(args)
    except rendezvous.RendezvousError as exc:
        return _fail(str(exc))
    if not launch.hosts_collector:
        return run_without_collector(launch, args)
    if args.run_dir is None:
        return lifecycle.run_script(launch, args, rundir.default_run_dir(launch.script.name))
    try:
        rundir.check_not_taken(args.run_dir)
    except rundir.RunDirError as exc:
        return _fail(str(exc))
    return lifecycle.run_script(launch, args, args.run_dir)


# -- traceml view ------------------------------------------------------------------------------
def view_command(args: argparse.Namespace) -> int:
    from traceml.views.web.app import view_finished_run

    try:
        view_finished_run(args.run_dir, args.host, args.port, _say)
    except OSError as exc:
        return _fail(str(exc))
    return 0


# -- traceml compare / export -----------------------------------------------------------------
def compare_command(args: argparse.Namespace) -> int:
    from traceml.report.compare import ComparedRun, compare
    from traceml.views.compare import print_comparison

    try:
        runs = [ComparedRun.load(path) for path in (args.run_a, args.run_b)]
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"cannot compare: {exc}")
    result = compare(*runs)
    if args.json:
        import json

        print(json.dumps(result, indent=2))
    else:
        print_comparison(result)
    return 0


def export_command(args: argparse.Namespace) -> int:
    from traceml.views.export import export_run

    try:
        count, target = export_run(args.run_dir, args.format, args.steps, args.out)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    if target != "-":
        _say(f"traceml: {count} step records written to {target}")
    return 0


# -- python train.py: the collector process rank 0 starts (rendezvous.spawn_collector_process) --
def collect_command(args: argparse.Namespace) -> int:
    from traceml.lifecycle import host_collector

    return host_collector(args.script, args.parent_pid, args.host, args.port, args.ready_fd,
                          args.web_host, args.web_port)


if __name__ == "__main__":
    entry()
