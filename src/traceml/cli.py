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
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from traceml.launcher import DEFAULT_RDZV_TIMEOUT_S, AgentWatch, Launch

log = logging.getLogger("traceml")

DEFAULT_WEB_PORT = 8765
SSE_FAREWELL_S = 1.5  # after the run, how long the page has to receive its last update
# After a node's ranks exit, how long the collector waits for ranks still to say goodbye
# (a dead rank never does); across nodes, six times as long.
RANK_GOODBYE_TIMEOUT_S = 5.0


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
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
    _web_arguments(run)
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
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    view = commands.add_parser("view", help="reopen a finished run in the web dashboard",
                               description="Serve a run directory's telemetry.sqlite in the web "
                                           "dashboard (read-only) until Ctrl-C.")
    view.add_argument("run_dir", type=Path, help="the run's directory (holds telemetry.sqlite)")
    _web_arguments(view)

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

    collect = commands.add_parser("_collect", help=argparse.SUPPRESS)
    collect.add_argument("--ready-fd", type=int, required=True)
    collect.add_argument("--parent-pid", type=int, required=True)
    collect.add_argument("--script", required=True)
    collect.add_argument("--host", default="127.0.0.1")
    collect.add_argument("--port", type=int, default=0)
    collect.add_argument("--web-port", type=int, default=None)
    collect.add_argument("--web-host", default="127.0.0.1")
    return parser


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


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range (0-65535)")
    return port


def _fail(message: str, code: int = 2) -> int:
    print(f"traceml: {message}", file=sys.stderr)
    return code


# -- traceml run --------------------------------------------------------------------------------
def run_command(args: argparse.Namespace) -> int:
    from traceml import rendezvous, rundir

    if not Path(args.script).is_file():
        return _fail(f"no such script: {args.script}")
    try:
        launch = Launch(args)
    except rendezvous.RendezvousError as exc:
        return _fail(str(exc))
    if not launch.hosts_collector:
        return _run_without_collector(launch, args)
    if args.run_dir is not None:
        try:
            rundir.check_not_taken(args.run_dir)
        except rundir.RunDirError as exc:
            return _fail(str(exc))
        run_dir = args.run_dir
    else:
        run_dir = rundir.default_run_dir(launch.script.name)

    writable_dir, warning = rundir.prepare(run_dir)
    if warning:
        print(warning, file=sys.stderr)
    try:
        listening = rendezvous.listen(launch.collector_host, launch.collector_port)
    except OSError as exc:
        return _fail(f"cannot listen on {launch.collector_host}:{launch.collector_port} "
                     f"for the collector: {exc.strerror or exc}")
    address = f"{launch.collector_host}:{listening.getsockname()[1]}"  # as Collector.address
    env = _probe_env(args)
    env[rendezvous.ENV_COLLECTOR] = address
    env[rendezvous.ENV_RUN_DIR] = os.fspath(run_dir)
    started = time.time()
    mode = args.mode or ("cli" if sys.stdout.isatty() else "summary")
    live = mode == "cli"
    # The dashboard's and /metrics' ports are checked before the script starts (one in use
    # says so and runs nothing), so those views and the collector they read start first.
    # Otherwise the script starts at once and the collector is set up while it imports: what
    # `traceml run` adds to a run's wall time is its own start and the end-of-run files.
    web = metrics_server = None
    if mode == "dashboard" or args.metrics_port is not None:
        try:
            store, collector = _start_collector(writable_dir, launch.collector_host, listening)
            web, metrics_server = _start_views(args, mode, writable_dir, store, collector,
                                               launch.script.name, started)
        except OSError as exc:
            listening.close()
            return _fail(str(exc))
    output_fd = terminal_fd = None
    if live:  # the script writes to a terminal of its own; the dashboard shows it above itself
        try:
            output_fd, terminal_fd = _open_terminal()
        except OSError as exc:
            print(f"traceml: no live dashboard ({exc}); the card comes at the end", file=sys.stderr)
    try:
        if terminal_fd is not None:
            child = subprocess.Popen(launch.command(), env=env, stdout=terminal_fd, stderr=terminal_fd)
            os.close(terminal_fd)
        else:
            child = subprocess.Popen(launch.command(), env=env)
    except OSError as exc:
        listening.close()
        if web is not None or metrics_server is not None:
            collector.stop()
            _stop_views(web, metrics_server)
        return _fail(f"cannot start {launch.script}: {exc}")
    if web is None and metrics_server is None:
        threading.Thread(target=_import_end_of_run, name="traceml-warm", daemon=True).start()
        try:
            store, collector = _start_collector(writable_dir, launch.collector_host, listening)
        except OSError as exc:  # the script runs on untraced: its probe finds no collector
            listening.close()
            print(f"traceml: {exc}; the script runs untraced", file=sys.stderr)
            return _wait(child)
    from traceml.collector.system import SystemSampler

    child_pids: Set[int] = set()
    sampler = SystemSampler(collector.ingest, lambda: child_pids | collector.training_pids)
    child_pids.add(child.pid)
    rundir.update_run_json(writable_dir, {
        "status": "running", "collector": address, "script": os.fspath(launch.script),
        "argv": [os.fspath(launch.script), *launch.script_args], "started_at": rundir.iso_time(started),
        "pids": {"launcher": os.getpid(), "script": child.pid},
        "dashboard": web.url if web is not None else None})
    sampler.start()
    watch = AgentWatch(child) if launch.distributed else None
    if output_fd is not None:
        exit_code = _wait_with_dashboard(child, output_fd, collector, launch.script.name)
    else:
        exit_code = _wait(child)
    exit_code = _launch_ended(launch, watch, exit_code)
    ended = time.time()

    # Ranks on other nodes may still be saying goodbye; a dead rank simply never does.
    collector.wait_for_ranks(timeout_s=RANK_GOODBYE_TIMEOUT_S * (6 if launch.nnodes > 1 else 1))
    sampler.stop()
    collector.stop()
    from traceml.views.summary import RunFacts

    facts = RunFacts(script=launch.script.name, argv=[os.fspath(launch.script), *launch.script_args],
                     exit_code=exit_code, started_at_unix_s=started, ended_at_unix_s=ended)
    summary = finish_run(store, writable_dir, facts)
    rundir.update_run_json(writable_dir, {
        "status": "finished", "exit_code": exit_code, "ended_at": rundir.iso_time(ended),
        "rank_pids": sorted(collector.training_pids)})
    if metrics_server is not None:
        metrics_server.shutdown()
    if web is not None:
        _close_dashboard(web, summary, writable_dir)
    return exit_code


def _start_collector(run_dir: Optional[Path], host: str, listening: Any) -> Tuple[Any, Any]:
    """The run's store and the collector serving the bound socket (rendezvous.listen); OSError
    with the one line to say when they cannot start."""
    from traceml import rendezvous, rundir
    from traceml.collector.server import Collector
    from traceml.collector.store import Store

    port = listening.getsockname()[1]
    try:
        store = Store(rundir.store_path(run_dir))
        collector = Collector(store, host, port, token=os.environ.get(rendezvous.ENV_TOKEN, ""))
        collector.start(listening)
    except Exception as exc:  # the run dir's database (sqlite3) or the socket
        raise OSError(f"cannot start the collector on {host}:{port}: "
                      f"{getattr(exc, 'strerror', None) or exc}") from None
    return store, collector


def _import_end_of_run() -> None:
    """Import what finish_run needs while the script runs (the launcher is idle then), so the
    card and the files follow the script's end by the time they take to compute."""
    import importlib

    try:
        importlib.import_module("traceml.views.report")
        importlib.import_module("traceml.views.summary").prepare_card()
    except Exception:  # finish_run imports them again and says what went wrong
        log.debug("could not import the end-of-run views early", exc_info=True)


def _start_views(args: argparse.Namespace, mode: str, run_dir: Optional[Path], store: Any,
                 collector: Any, script: str, started: float) -> Tuple[Any, Any]:
    """The web dashboard (--mode dashboard) and /metrics (--metrics-port) over the live run;
    raises OSError with the one line to say when one cannot be served (and stops the other)."""
    if mode != "dashboard" and args.metrics_port is None:
        return None, None
    from traceml.views.web.app import PortInUse, RunSource, serve_run

    web = metrics_server = None
    if mode == "dashboard":
        try:
            web = serve_run(RunSource.of_live_run(run_dir, store, collector, script, started),
                            args.host, args.port, _say)
        except (PortInUse, OSError) as exc:
            raise OSError(f"cannot serve the dashboard: {exc}") from None
    if args.metrics_port is not None:
        source = web.source if web is not None else RunSource.of_live_run(
            run_dir, store, collector, script, started)
        try:
            metrics_server = _serve_metrics(source, args.host, args.metrics_port, owns_source=web is None)
        except OSError as exc:
            _stop_views(web, None)
            raise OSError(f"cannot serve /metrics on {args.host}:{args.metrics_port}: "
                          f"{exc.strerror or exc}") from None
    return web, metrics_server


def _stop_views(web: Any, metrics_server: Any) -> None:
    if metrics_server is not None:
        metrics_server.shutdown()
    if web is not None:
        web.stop()


def _serve_metrics(source: Any, host: str, port: int, owns_source: bool) -> Any:
    """prometheus-client's own HTTP server for /metrics, on a thread; raises OSError."""
    from prometheus_client import start_http_server

    from traceml.views.metrics import registry_for

    server, _ = start_http_server(port, addr=host, registry=registry_for(source.collector, source.live_state))
    _say(f"traceml: Prometheus metrics at http://{host}:{server.server_port}/metrics")
    return MetricsServer(server, source if owns_source else None)


class MetricsServer:
    """The /metrics server, and the live source it reads when it is its own; closed with the run."""

    def __init__(self, server: Any, own_source: Any):
        self.server, self.own_source = server, own_source

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.own_source is not None:
            self.own_source.close()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _close_dashboard(web: Any, summary: Optional[dict], run_dir: Optional[Path]) -> None:
    """The page shows the final verdict, then the server goes with the run."""
    from traceml import rundir

    if summary is not None:
        web.source.summary = summary
        time.sleep(SSE_FAREWELL_S)
    web.stop()
    if run_dir is not None:
        # The collector closed its store while the page still read it, so SQLite left the
        # write-ahead log beside it: the last connection folds it back into the one file.
        try:
            from traceml.collector.store import Store

            Store(rundir.store_path(run_dir)).close()
        except Exception as exc:
            log.debug("could not fold the store's log back: %s", exc)
        _say(f"traceml: reopen the dashboard with: traceml view {run_dir}")


def _probe_env(args: argparse.Namespace) -> Dict[str, str]:
    """The training processes' environment: this one, with the probe's options."""
    from traceml import rendezvous

    env = dict(os.environ)
    if args.deep:
        env[rendezvous.ENV_DEEP] = "1"
    if not args.auto_capture:
        env[rendezvous.ENV_AUTO_CAPTURE] = "0"
    return env


def _run_without_collector(launch: Launch, args: argparse.Namespace) -> int:
    """A node other than 0: its ranks send to node 0's collector, which prints the card."""
    from traceml import rendezvous

    env = _probe_env(args)
    env[rendezvous.ENV_COLLECTOR] = f"{launch.master_addr}:{launch.collector_port}"
    try:
        child = subprocess.Popen(launch.command(), env=env)
    except OSError as exc:
        return _fail(f"cannot start {launch.script}: {exc}")
    watch = AgentWatch(child)
    exit_code = _launch_ended(launch, watch, _wait(child))
    print(f"traceml: node {launch.node_rank} done (exit code {exit_code}); node 0 prints the "
          "card and keeps the run", file=sys.stderr)
    return exit_code


def _launch_ended(launch: Launch, watch: Optional[AgentWatch], exit_code: int) -> int:
    """The node's exit code once torch.distributed.run has gone, on its own or stopped by the
    watch; a launch whose ranks never started says why."""
    if watch is None:
        return exit_code
    watch.stop()
    if watch.stopped_after_success:
        return 0
    if exit_code != 0 and not watch.ranks_seen:
        print(launch.never_started_line(exit_code), file=sys.stderr, flush=True)
    return exit_code


def _open_terminal() -> Tuple[int, int]:
    """A pseudo-terminal the size of ours: the script still sees a terminal (line-buffered
    output, progress bars) while its output reaches us to print above the dashboard."""
    import fcntl
    import pty
    import termios

    main_fd, terminal_fd = pty.openpty()
    try:
        size = fcntl.ioctl(sys.stdout.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, size)
    except OSError:
        pass
    return main_fd, terminal_fd


def _wait_with_dashboard(child: subprocess.Popen, output_fd: int, collector: Any, script: str) -> int:
    from traceml.views.terminal import Dashboard

    restore = _forward_signals(child)
    try:
        try:
            Dashboard(collector, script).run(child, output_fd)
        except Exception as exc:  # the dashboard is a view: if it fails, the run goes on
            log.warning("traceml: live dashboard stopped (%s); the card comes at the end", exc)
            _drain(output_fd, child)
        returncode = child.wait()
    finally:
        restore()
        os.close(output_fd)
    return 128 - returncode if returncode < 0 else returncode


def _drain(output_fd: int, child: subprocess.Popen) -> None:
    """Copy the script's output to ours until it ends, as if no dashboard were there."""
    while True:
        readable, _, _ = select.select([output_fd], [], [], 0.5)
        if readable:
            try:
                chunk = os.read(output_fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                return
            os.write(sys.stdout.fileno(), chunk)
        elif child.poll() is not None:
            return


def _wait(child: subprocess.Popen) -> int:
    """Wait for the script, forwarding signals; its exit code, 128+N if signal N killed it."""
    restore = _forward_signals(child)
    try:
        returncode = child.wait()
    finally:
        restore()
    return 128 - returncode if returncode < 0 else returncode


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


# -- traceml view ------------------------------------------------------------------------------
def view_command(args: argparse.Namespace) -> int:
    from traceml.views.web.app import PortInUse, RunSource, serve_run

    try:
        source = RunSource.of_finished_run(args.run_dir)
    except (OSError, ValueError) as exc:
        return _fail(f"cannot open {args.run_dir}: {exc}")
    except Exception as exc:  # a store SQLite cannot read
        return _fail(f"cannot read the run in {args.run_dir}: {exc}")
    try:
        web = serve_run(source, args.host, args.port, _say)
    except (PortInUse, OSError) as exc:
        return _fail(f"cannot serve the dashboard: {exc}")
    _say("traceml: serving until Ctrl-C")
    import threading

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        web.stop()
    return 0


# -- traceml compare / export -----------------------------------------------------------------
def compare_command(args: argparse.Namespace) -> int:
    from traceml.views.compare import ComparedRun, compare, render

    try:
        runs = [ComparedRun.load(path) for path in (args.run_a, args.run_b)]
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"cannot compare: {exc}")
    result = compare(*runs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        Console(highlight=False).print(render(result))
    return 0


def export_command(args: argparse.Namespace) -> int:
    from traceml import rundir
    from traceml.collector.store import Store
    from traceml.views.export import SUFFIX, export, parse_steps

    try:
        first, last = parse_steps(args.steps)
    except ValueError as exc:
        return _fail(str(exc))
    store_path = args.run_dir / rundir.STORE_NAME
    if not store_path.is_file():
        return _fail(f"{args.run_dir} holds no {rundir.STORE_NAME}: not a TraceML run directory")
    store = Store(os.fspath(store_path), readonly=True)
    target = args.out or os.fspath(args.run_dir / SUFFIX[args.format])
    try:
        if target == "-":
            count = export(store, args.format, first, last, sys.stdout)
        else:
            with open(target, "w", newline="") as out:
                count = export(store, args.format, first, last, out)
    except OSError as exc:
        return _fail(f"cannot write {target}: {exc.strerror or exc}")
    finally:
        store.close()
    if target != "-":
        _say(f"traceml: {count} step records written to {target}")
    return 0


# -- python train.py: the collector process rank 0 starts (rendezvous.spawn_collector_process) --
def collect_command(args: argparse.Namespace) -> int:
    # Ctrl-C reaches the whole process group: the collector must outlive it to write the summary.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from traceml import rendezvous, rundir
    from traceml.collector.server import Collector
    from traceml.collector.store import Store
    from traceml.collector.system import SystemSampler

    try:
        host = rendezvous.bind_host(args.host)
    except rendezvous.RendezvousError as exc:
        os.write(args.ready_fd, f"error: {exc}\n".encode())
        return 2
    run_dir = Path(os.environ.get(rendezvous.ENV_RUN_DIR) or rundir.default_run_dir(args.script))
    writable_dir, warning = rundir.prepare(run_dir)
    if warning:
        print(warning, file=sys.stderr)
    store = Store(rundir.store_path(writable_dir))
    collector = Collector(store, host, args.port, token=os.environ.get(rendezvous.ENV_TOKEN, ""))
    try:
        address = collector.start()
        os.write(args.ready_fd, f"{address}\n".encode())
    except OSError as exc:
        os.write(args.ready_fd, f"error: cannot listen on {host}:{args.port}: {exc}\n".encode())
        return 2
    finally:
        os.close(args.ready_fd)
    sampler = SystemSampler(collector.ingest, lambda: collector.training_pids)
    sampler.start()
    started = time.time()
    rundir.update_run_json(writable_dir, {
        "status": "running", "collector": address, "script": args.script,
        "started_at": rundir.iso_time(started),
        "pids": {"collector": os.getpid(), "rank0": args.parent_pid}})
    web = None
    if args.web_port is not None:
        from traceml.views.web.app import PortInUse, RunSource, serve_run

        try:
            web = serve_run(RunSource.of_live_run(writable_dir, store, collector,
                                                  Path(args.script).name, started),
                            args.web_host, args.web_port, _say)
        except (PortInUse, OSError) as exc:  # the run goes on, with the card at its end
            _say(f"traceml: no web dashboard: {exc}")
    # SIGTERM to the whole group (a job's time limit, a kill of the process group) reaches us
    # too: the ranks flush on theirs, we keep the run and summarize it, then go.
    import threading

    stop_asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_asked.set())
    parent_gone = lambda: not _alive(args.parent_pid)  # noqa: E731
    give_up = lambda: parent_gone() or stop_asked.is_set()  # noqa: E731
    collector.wait_for_ranks(timeout_s=float("inf"), until=give_up)
    if give_up():
        # Rank 0 is gone without waiting for us, or we are told to stop: give the ranks
        # a moment to send their last records.
        collector.wait_for_ranks(timeout_s=RANK_GOODBYE_TIMEOUT_S)
    sampler.stop()
    collector.stop()
    from traceml.views.summary import RunFacts

    facts = RunFacts.from_store(store, script=args.script)
    summary = finish_run(store, writable_dir, facts)
    rundir.update_run_json(writable_dir, {
        "status": "finished", "exit_code": facts.exit_code, "ended_at": rundir.iso_time(time.time()),
        "rank_pids": sorted(collector.training_pids)})
    if web is not None:
        _close_dashboard(web, summary, writable_dir)
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
    except Exception as exc:
        print(f"traceml: could not summarize the run: {exc}", file=sys.stderr)
        log.debug("summary failed", exc_info=True)
        return None
    try:
        sys.stdout.flush()
        print_card(summary)
    except Exception as exc:  # a closed stdout must not cost the files
        log.debug("could not print the card: %s", exc)
    if run_dir is not None:  # the summary files first: on a full disk, the reserve is theirs
        rundir.release_reserve(run_dir)
        written = _write_files(run_dir, [(rundir.SUMMARY_JSON, lambda: json.dumps(summary, indent=2) + "\n"),
                                         (rundir.SUMMARY_TXT, lambda: card_text(summary))])
    try:  # the findings and facts also go in the store, where there is room for them
        store.write_findings(data.findings)
        store.set_meta({"run": summary["run"], "steps": summary["steps"]})
    except Exception as exc:  # a full disk was already reported by the collector
        log.debug("could not save the summary in the store: %s", exc)
    try:
        store.close()
    except Exception as exc:
        log.debug("could not close the store: %s", exc)
    if run_dir is not None:
        written += _write_files(run_dir, [(rundir.REPORT_HTML, lambda: render_report(summary, data.rolled))])
        if written:
            print(f"traceml: run saved to {run_dir}", file=sys.stderr)
    return summary


def _write_files(run_dir: Path, files: List[Tuple[str, Callable[[], str]]]) -> int:
    """Write each file that fits, saying which did not; how many were written."""
    written = 0
    for name, text in files:
        try:
            (run_dir / name).write_text(text())
            written += 1
        except OSError as exc:
            print(f"traceml: could not write {run_dir / name}: {exc.strerror or exc}", file=sys.stderr)
            try:
                (run_dir / name).unlink()  # no half file
            except OSError:
                pass
    return written


if __name__ == "__main__":
    sys.exit(main())
