"""The `traceml` command line: parse the arguments and hand each command to the module that does it.

`traceml run` goes to lifecycle.run_script (the run's collector side) and launcher.py (the
script's processes); `_collect`, the collector rank 0 of a plain `python train.py` starts,
to lifecycle.collect_main; view, compare and export to their views.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from pathlib import Path
from typing import Callable, List, Optional, TypeVar

from traceml import lifecycle, rundir
from traceml.records import ALL_PHASES
from traceml.rendezvous import COLLECT_COMMAND
from traceml.report.compare import GATE_THRESHOLD
from traceml.launcher import DEFAULT_RDZV_TIMEOUT_S, Launch, run_without_collector
from traceml.lifecycle import fail as _fail
from traceml.lifecycle import say as _say


DEFAULT_WEB_PORT = 8765
N = TypeVar("N", int, float)  # what an argument is read as


def entry() -> None:
    """The `traceml` command: main, then out at once. By then the run's files are written and
    closed and no thread has work left; unloading the modules the summary used would only add
    ~30 ms to every `traceml run`."""
    exit_code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more can be said
            stream.flush()
    os._exit(exit_code if isinstance(exit_code, int) else 1)


def main(argv: Optional[List[str]] = None) -> int:
    # No logging.basicConfig: its handler would be the script's too once `traceml run` forks
    # it (launcher.ScriptFork), and the script's own basicConfig would then do nothing.
    # Unconfigured, logging prints warnings as "%(message)s" on stderr all the same.
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [COLLECT_COMMAND]:  # internal, so kept out of the parser every user sees
        return lifecycle.collect_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    commands = {"run": run_command, "view": view_command, "compare": compare_command, "export": export_command}
    if args.command in commands:
        return commands[args.command](args)
    parser.print_help()
    return 2


def _parser() -> argparse.ArgumentParser:
    from traceml import __version__

    parser = argparse.ArgumentParser(prog="traceml", description="Always-on observability for "
                                     "PyTorch training: where each step's time and memory go.",
                                     epilog="example: traceml run train.py --epochs 1")
    parser.add_argument("-V", "--version", action="version", version=f"traceml {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = _command(commands, "run", "run a training script under TraceML",
                   "Run SCRIPT with the same Python under a collector; print the card and write the "
                   "run directory at the end.",
                   "traceml run --mode summary train.py --lr 3e-4")
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
    _web_arguments(run).add_argument("--metrics-port", type=_port, default=None, metavar="P",
                                     help="serve Prometheus /metrics on P while the run trains (any mode; "
                                          "the dashboard serves /metrics too)")
    _distributed_arguments(run)
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    view = _command(commands, "view", "reopen a finished run in the web dashboard",
                    "Serve a run directory's telemetry.sqlite in the web dashboard (read-only) "
                    "until Ctrl-C.", "traceml view traceml_runs/20261205-101500-train")
    view.add_argument("run_dir", type=Path, help="the run's directory (holds telemetry.sqlite)")
    _web_arguments(view)
    _other_commands(commands)
    return parser


def _distributed_arguments(run: argparse.ArgumentParser) -> None:
    distributed = run.add_argument_group("distributed (launched through torch.distributed.run)")
    distributed.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                             help="ranks on this node")
    distributed.add_argument("--nnodes", type=int, default=1, metavar="M",
                             help="nodes in the run (default 1)")
    distributed.add_argument("--node-rank", type=int, default=0, metavar="R",
                             help="this node's rank among them (default 0)")
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
    compare = _command(commands, "compare", "did my change help? two runs, phase by phase",
                       "Compare two runs (run directories, final_summary.json files, or folders of "
                       "repeated runs): medians per phase with intervals, a verdict, the change in "
                       "diagnosis and the environment. With --fail-on regression it is a CI gate: "
                       "exit 1 on a regression beyond the threshold, 3 when the runs cannot tell, "
                       "0 otherwise.",
                       "traceml compare runs/base runs/new --fail-on regression --threshold 15")
    compare.add_argument("run_a", type=Path, help="the baseline: a run, or a folder of repeated runs")
    compare.add_argument("run_b", type=Path, help="the changed run, or a folder of repeated runs")
    compare.add_argument("--json", action="store_true",
                         help="print the comparison (and the gate's decision) as JSON")
    gate = compare.add_argument_group("regression gate")
    gate.add_argument("--fail-on", choices=("regression",), default=None,
                      help="exit 1 when B is a regression beyond --threshold")
    gate.add_argument("--threshold", type=_percent, default=None, metavar="PCT",
                      help="how much slower counts as a regression, in percent of the baseline "
                           f"(default {GATE_THRESHOLD * 100:g}%%)")
    gate.add_argument("--phase", choices=("step",) + ALL_PHASES, default="step", metavar="NAME",
                      help="judge this phase's median instead of the step's: one of "
                           + ", ".join(ALL_PHASES))
    gate.add_argument("--inconclusive-ok", action="store_true",
                      help="exit 0, not 3, when the runs are too short or too noisy to tell")

    export = _command(commands, "export", "a run's records as a Perfetto trace, JSON lines or CSV",
                      "Write a finished run's step records (with phases, spans and memory) to a "
                      "file: chrome is a trace that Perfetto and chrome://tracing open; jsonl "
                      "and csv are one step a line.",
                      "traceml export traceml_runs/20261205-101500-train --format chrome")
    export.add_argument("run_dir", type=Path, help="the run's directory (holds telemetry.sqlite)")
    export.add_argument("--format", choices=("chrome", "jsonl", "csv"), required=True,
                        help="chrome (Perfetto), jsonl or csv")
    export.add_argument("--steps", default=None, metavar="A:B",
                        help="only steps A to B, inclusive (either side may be left out)")
    export.add_argument("--out", default=None, metavar="FILE",
                        help="where to write ('-' for stdout; default: a file in the run dir)")


def _command(commands: "argparse._SubParsersAction", name: str, summary: str, description: str,
             example: str) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does and shows one line that uses it."""
    # Raw, so that the example stays on one line to copy; the description is wrapped here.
    return commands.add_parser(name, help=summary, description=textwrap.fill(description, 78),
                               epilog=f"example: {example}",
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def _web_arguments(parser: argparse.ArgumentParser) -> "argparse._ArgumentGroup":
    web = parser.add_argument_group("web dashboard")
    web.add_argument("--port", type=_port, default=DEFAULT_WEB_PORT, metavar="P",
                     help=f"the dashboard's port; the next free one if taken (default {DEFAULT_WEB_PORT})")
    web.add_argument("--host", default="127.0.0.1", metavar="H",
                     help="the address to serve on (default 127.0.0.1: this machine only)")
    return web


def _number(text: str, convert: Callable[[str], N], what: str) -> N:
    """The argument as `convert` reads it; an argparse error naming `what` when it cannot."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def _seconds(text: str) -> float:
    seconds = _number(text, float, "a number of seconds")
    if not seconds >= 1.0:
        raise argparse.ArgumentTypeError(f"{text} s is too short: at least 1")
    return seconds


def _percent(text: str) -> float:
    """A threshold in percent ("10", "10%", "2.5") as a fraction of the baseline."""
    percent = _number(text, lambda raw: float(raw.rstrip("%")), "a percentage")
    if not 0.0 <= percent < 1000.0:
        raise argparse.ArgumentTypeError(f"{text}% is out of range (0 to 1000)")
    return percent / 100.0


def _port(text: str) -> int:
    port = _number(text, int, "a port number")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range (0-65535)")
    return port


# -- traceml run --------------------------------------------------------------------------------
def run_command(args: argparse.Namespace) -> int:
    from traceml import rendezvous

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
    from traceml.report.compare import ComparedRun, compare, gate
    from traceml.views.compare import print_comparison

    if not args.fail_on and (args.threshold is not None or args.phase != "step" or args.inconclusive_ok):
        return _fail("--threshold, --phase and --inconclusive-ok need --fail-on regression")
    try:
        runs = [ComparedRun.load(path) for path in (args.run_a, args.run_b)]
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"cannot compare: {exc}")
    result = compare(*runs)  # type: ignore[arg-type]  # two runs: run_a and run_b
    if args.fail_on:
        result["gate"] = gate(result, args.phase, args.threshold, args.inconclusive_ok)
    if args.json:
        import json

        print(json.dumps(result, indent=2))
    else:
        print_comparison(result)
    return result["gate"]["exit_code"] if args.fail_on else 0


def export_command(args: argparse.Namespace) -> int:
    from traceml.views.export import export_run

    try:
        count, target = export_run(args.run_dir, args.format, args.steps, args.out)
    except (ValueError, OSError, rundir.RunDirError) as exc:
        return _fail(str(exc))
    if target != "-":
        _say(f"traceml: {count} step records written to {target}")
    return 0


if __name__ == "__main__":
    entry()
