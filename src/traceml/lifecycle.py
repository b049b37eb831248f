"""One run's collector side from start to end: store, collector, system sampler, run.json, the
live views, and the end-of-run files and card.

`traceml run` (run_script) and the collector that rank 0 of a plain `python train.py` starts
(host_collector) both go through `Run`: they differ only in what they wait for.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from traceml import agent, rendezvous, rundir

if TYPE_CHECKING:
    import socket
    from wsgiref.simple_server import WSGIServer

    from traceml.collector.store import Store
    from traceml.launcher import Launch
    from traceml.report.run_source import RunSource
    from traceml.report.summary import FinalSummary, RunFacts
    from traceml.views.alerts import AlertCommand
    from traceml.views.web.app import WebServer

log = logging.getLogger("traceml")

SSE_FAREWELL_S = 1.5  # after the run, how long the page has to receive its last update
# After a node's ranks exit, how long the collector waits for ranks still to say goodbye
# (a dead rank never does); across nodes, six times as long.
RANK_GOODBYE_TIMEOUT_S = 5.0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Run:
    """The run directory, the store, the collector fed by the ranks (with the live rollup and
    the wall-time tally the live views and the summary read) and the system sampler."""

    def __init__(self, run_dir: Path):
        self.run_dir, warning = rundir.prepare(run_dir)  # None when nothing can be written
        if warning:
            print(warning, file=sys.stderr)
        self.store: Any = None
        self.collector: Any = None
        self.sampler: Any = None
        self.started_unix_s = time.time()

    def start_collector(self, host: str, listening: Optional[socket.socket] = None, port: int = 0) -> str:
        """Open the store and serve the collector (on `listening`, a socket rendezvous.listen
        bound, or on host:port); its address. OSError with the one line to say otherwise."""
        from traceml.analysis.goodput import RunTime
        from traceml.analysis.rollup import LiveRollup
        from traceml.collector.server import Collector
        from traceml.collector.store import Store
        from traceml.report.live import HangWatch

        if listening is not None:
            port = listening.getsockname()[1]
        try:
            self.store = Store(rundir.store_path(self.run_dir))
            self.collector = Collector(self.store, host, port, token=os.environ.get(rendezvous.ENV_TOKEN, ""),
                                       live=LiveRollup(), run_time=RunTime(), hang_watch=HangWatch())
            return self.collector.start(listening)
        except Exception as exc:  # the run dir's database (sqlite3) or the socket
            raise OSError(f"cannot start the collector on {host}:{port}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None

    def start_sampling(self, pids: Callable[[], Set[int]], run_json: dict) -> None:
        """Sample the machine and the training processes (`pids` and every rank that said
        hello) while the run goes on; run.json says it is running."""
        from traceml.collector.system import SystemSampler

        collector = self.collector
        self.sampler = SystemSampler(collector.ingest, lambda: pids() | collector.training_pids)
        rundir.update_run_json(self.run_dir, {"status": "running", "collector": collector.address,
                                              "started_at": rundir.iso_time(self.started_unix_s), **run_json})
        self.sampler.start()

    def record_rank_exits(self, exits: Mapping[int, Mapping[str, Optional[int]]]) -> None:
        """How the ranks that failed ended (their exit status, negative for a signal), for the
        summary: a rank that died without a goodbye is named with it."""
        failed = {str(rank): status for rank, status in exits.items() if status.get("exit_code")}
        if failed:
            try:
                self.store.set_meta({"rank_exits": failed})
            except Exception as exc:  # a full disk: the summary names the rank without its status
                log.debug("could not keep the ranks' exit status: %s", exc)

    def finish(self, facts_of: Callable[[Store], RunFacts]) -> Optional[FinalSummary]:
        """Stop sampling and collecting, then summarize the store, print the card and write the
        run directory; the summary (None when it failed). `facts_of(store)`: the RunFacts, whose
        end run.json gives."""
        self.sampler.stop()
        self.collector.stop()
        facts = facts_of(self.store)
        summary = finish_run(self.store, self.run_dir, facts)
        rundir.update_run_json(self.run_dir, {
            "status": "finished", "exit_code": facts.exit_code,
            "ended_at": rundir.iso_time(facts.ended_at_unix_s),
            "rank_pids": sorted(self.collector.training_pids)})
        return summary


# -- traceml run, on the node that hosts the collector -------------------------------------------
def run_script(launch: Launch, options: argparse.Namespace, run_dir: Path) -> int:
    """Run the launch's script under a collector, with the live view `options.mode` asks for,
    and finish the run; the script's exit code."""
    from traceml import launcher

    run = Run(run_dir)
    try:
        listening = rendezvous.listen(launch.collector_host, launch.collector_port)
    except OSError as exc:
        return fail(f"cannot listen on {launch.collector_host}:{launch.collector_port} "
                    f"for the collector: {exc.strerror or exc}")
    address = f"{launch.collector_host}:{listening.getsockname()[1]}"  # as Collector.address
    env, exits_file = _script_env(launch, options, address, run_dir)
    mode = options.mode or ("cli" if sys.stdout.isatty() else "summary")
    # The dashboard's and /metrics' ports are checked before the script starts (one in use
    # says so and runs nothing), so those views and the collector they read start first.
    # Otherwise the script starts at once and the collector is set up while it imports: what
    # `traceml run` adds to a run's wall time is its own start and the end-of-run files.
    views = LiveViews()
    if mode == "dashboard" or options.metrics_port is not None or options.on_alert:
        try:
            run.start_collector(launch.collector_host, listening)
            views.start(options, mode, run, launch.script.name)
        except OSError as exc:
            listening.close()
            return fail(str(exc))
    try:
        child, output_fd = launcher.start_script(launch, env, with_terminal=mode == "cli", not_for_script=[listening])
    except OSError as exc:
        listening.close()
        if run.collector is not None:
            run.collector.stop()
            views.stop()
        return fail(f"cannot start {launch.script}: {exc}")
    if run.collector is None:
        threading.Thread(target=_import_end_of_run, name="traceml-warm", daemon=True).start()
        try:
            run.start_collector(launch.collector_host, listening)
        except OSError as exc:  # the script runs on untraced: its probe finds no collector
            listening.close()
            print(f"traceml: {exc}; the script runs untraced", file=sys.stderr)
            return launcher.wait(child, output_fd=output_fd)  # its terminal's output still read
    argv = launch.script_argv
    run.start_sampling(lambda: {child.pid}, {
        "script": os.fspath(launch.script), "argv": argv,
        "pids": {"launcher": os.getpid(), "script": child.pid},
        "dashboard": views.web.url if views.web is not None else None})
    exit_code = launcher.wait_for_launch(launch, child, output_fd, run.collector)
    ended = time.time()
    run.record_rank_exits(agent.read_exits(exits_file) if exits_file is not None
                          else {0: {"exit_code": child.returncode, "pid": child.pid}})  # type: ignore[dict-item]  # it has ended

    _hear_the_last_ranks(run, launch.nnodes)
    from traceml.report.summary import RunFacts

    summary = run.finish(lambda store: RunFacts(script=launch.script.name, argv=argv, exit_code=exit_code,
                                                started_at_unix_s=run.started_unix_s, ended_at_unix_s=ended))
    views.close(summary, run.run_dir)
    return exit_code


def _hear_the_last_ranks(run: Run, nnodes: int) -> None:
    """Read what the ranks sent last. On one node every rank's process has ended, and that is
    read at once; ranks on other nodes may still be saying goodbye (a dead rank never does)."""
    one_node = nnodes == 1
    run.collector.wait_for_ranks(timeout_s=RANK_GOODBYE_TIMEOUT_S * (1 if one_node else 6), ranks_exited=one_node)


def _script_env(launch: Launch, options: argparse.Namespace, collector_address: str,
                run_dir: Path) -> Tuple[Dict[str, str], Optional[str]]:
    """The script's environment (the probe's options, where to send, where the run's files go),
    and, for torch.distributed.run, the temporary file where traceml.agent will write the
    failed ranks' exit status (None without one)."""
    from traceml import launcher

    env = launcher.probe_env(options)
    env[rendezvous.ENV_COLLECTOR] = collector_address
    env[rendezvous.ENV_RUN_DIR] = os.fspath(run_dir)
    if not launch.distributed:
        return env, None
    import tempfile

    try:
        handle, exits_file = tempfile.mkstemp(prefix="traceml-exits-", suffix=".json")
    except OSError:  # no temporary directory: the summary names a dead rank without its status
        return env, None
    os.close(handle)
    os.unlink(exits_file)  # written only when a rank fails; read_exits removes it
    env[agent.ENV_EXITS_FILE] = exits_file
    return env, exits_file


def fail(message: str, code: int = 2) -> int:
    print(f"traceml: {message}", file=sys.stderr)
    return code


def _import_end_of_run() -> None:
    """Import what finish_run needs while the script runs (the launcher is idle then), so the
    card and the files follow the script's end by the time they take to compute."""
    import importlib

    try:
        importlib.import_module("traceml.report.summary")
        importlib.import_module("traceml.views.report")
        importlib.import_module("traceml.views.summary").prepare_card()
    except Exception:  # finish_run imports them again and says what went wrong
        log.debug("could not import the end-of-run views early", exc_info=True)


# -- python train.py: the collector process rank 0 starts (rendezvous.spawn_collector_process) --
def collect_main(argv: List[str]) -> int:
    """`python -m traceml _collect ...` (rendezvous.COLLECT_COMMAND): parse, then host_collector."""
    collect = argparse.ArgumentParser(prog=f"traceml {rendezvous.COLLECT_COMMAND}")
    collect.add_argument("--ready-fd", type=int, required=True)
    collect.add_argument("--parent-pid", type=int, required=True)
    collect.add_argument("--script", required=True)
    collect.add_argument("--host", default="127.0.0.1")
    collect.add_argument("--port", type=int, default=0)
    collect.add_argument("--web-port", type=int, default=None)
    collect.add_argument("--web-host", default="127.0.0.1")
    args = collect.parse_args(argv)
    return host_collector(args.script, args.parent_pid, args.host, args.port, args.ready_fd,
                          args.web_host, args.web_port)


def host_collector(script: str, parent_pid: int, host: str, port: int, ready_fd: int,
                   web_host: str, web_port: Optional[int]) -> int:
    """Collect the run rank 0 (`parent_pid`) trains until every rank has gone (or rank 0 went,
    or SIGTERM came), then finish it. The collector's address, or "error: ...", goes to
    `ready_fd` as one line as soon as it is known."""
    # Ctrl-C reaches the whole process group: the collector must outlive it to write the summary.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        host = rendezvous.bind_host(host)
        run = Run(Path(os.environ.get(rendezvous.ENV_RUN_DIR) or rundir.default_run_dir(script)))
        os.write(ready_fd, f"{run.start_collector(host, port=port)}\n".encode())
    except (rendezvous.RendezvousError, OSError) as exc:
        os.write(ready_fd, f"error: {exc}\n".encode())
        return 2
    finally:
        os.close(ready_fd)
    run.start_sampling(set, {"script": script, "pids": {"collector": os.getpid(), "rank0": parent_pid}})
    views = LiveViews()
    if web_port is not None:
        try:
            views.start_dashboard(web_host, web_port, run, Path(script).name)
        except OSError as exc:  # the run goes on, with the card at its end
            say(f"traceml: no web dashboard: {exc}")
    # SIGTERM to the whole group (a job's time limit, a kill of the process group) reaches us
    # too: the ranks flush on theirs, we keep the run and summarize it, then go.
    stop_asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_asked.set())
    give_up = lambda: not _alive(parent_pid) or stop_asked.is_set()  # noqa: E731
    run.collector.wait_for_ranks(timeout_s=float("inf"), until=give_up)
    if give_up():
        # Rank 0 is gone without waiting for us, or we are told to stop: give the ranks
        # a moment to send their last records.
        run.collector.wait_for_ranks(timeout_s=RANK_GOODBYE_TIMEOUT_S)
    from traceml.report.summary import RunFacts

    summary = run.finish(lambda store: RunFacts.from_store(store, script=script))
    views.close(summary, run.run_dir)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- the live views of a run ----------------------------------------------------------------------
class LiveViews:
    """The web dashboard and the /metrics server over a run while it goes on, and their close."""

    def __init__(self) -> None:
        self.web: Optional[WebServer] = None
        self.metrics_server: Optional[WSGIServer] = None
        self.alerts: Optional[AlertCommand] = None  # under --on-alert
        self._own_source: Optional[RunSource] = None  # the live state /metrics and the alerts read without the dashboard

    def start(self, options: argparse.Namespace, mode: str, run: Run, script: str) -> None:
        """The web dashboard (--mode dashboard), /metrics (--metrics-port) and the alert command
        (--on-alert); raises OSError with the one line to say when one cannot be served (and
        stops the others)."""
        if mode == "dashboard":
            self.start_dashboard(options.host, options.port, run, script)
        if options.on_alert:
            from traceml.views.alerts import AlertCommand

            self.alerts = AlertCommand(options.on_alert, self._source(run, script).live_state, script)
            self.alerts.start()
        if options.metrics_port is not None:  # prometheus-client's own HTTP server, on a thread
            from prometheus_client import start_http_server

            from traceml.views.metrics import registry_for

            host, port = options.host, options.metrics_port
            try:
                source = self._source(run, script)
                self.metrics_server, _ = start_http_server(port, addr=host, registry=registry_for(
                    source.collector, source.live_state))  # type: ignore[arg-type]  # live: _live_source hands it the run's collector
            except OSError as exc:
                self.stop()
                raise OSError(f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}") from None
            say(f"traceml: Prometheus metrics at http://{host}:{self.metrics_server.server_port}/metrics")

    def start_dashboard(self, host: str, port: int, run: Run, script: str) -> None:
        from traceml.views.web.app import serve_run

        try:
            self.web = serve_run(_live_source(run, script), host, port, say)
        except OSError as exc:  # PortInUse among them
            raise OSError(f"cannot serve the dashboard: {exc}") from None

    def _source(self, run: Run, script: str) -> RunSource:
        """The dashboard's live source, or one of this object's own without a dashboard."""
        if self.web is not None:
            return self.web.source
        if self._own_source is None:
            self._own_source = _live_source(run, script)
        return self._own_source

    def stop(self) -> None:
        if self.alerts is not None:
            self.alerts.stop()
            self.alerts = None
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
        if self._own_source is not None:
            self._own_source.close()
            self._own_source = None
        if self.web is not None:
            self.web.stop()
            self.web = None

    def close(self, summary: Optional[FinalSummary], run_dir: Optional[Path]) -> None:
        """The run is over: the page shows the final verdict, then the servers go with the run."""
        web = self.web
        if web is not None and summary is not None:
            web.source.summary = summary
            time.sleep(SSE_FAREWELL_S)
        self.stop()
        if web is not None and run_dir is not None:
            # The collector closed its store while the page still read it, so SQLite left the
            # write-ahead log beside it: the last connection folds it back into the one file.
            try:
                from traceml.collector.store import Store

                Store(rundir.store_path(run_dir)).close()
            except Exception as exc:
                log.debug("could not fold the store's log back: %s", exc)
            say(f"traceml: reopen the dashboard with: traceml view {run_dir}")


def _live_source(run: Run, script: str) -> RunSource:
    """What the live views read: report.run_source.RunSource over the run's store and collector."""
    from traceml.report.run_source import RunSource

    return RunSource.of_live_run(run.run_dir, run.store, run.collector, script, run.started_unix_s)


# -- the end of every run -------------------------------------------------------------------------
def finish_run(store: Store, run_dir: Optional[Path], facts: RunFacts) -> Optional[FinalSummary]:
    """Summarize the store, write the run directory, print the card. Never raises."""
    import json

    from traceml.report.summary import RunData, build_summary
    from traceml.views.report import render_report
    from traceml.views.summary import card_text, print_card

    try:
        data = RunData(store)
        summary = build_summary(data, facts)
    except Exception as exc:
        print(f"traceml: could not summarize the run: {exc}", file=sys.stderr)
        log.debug("summary failed", exc_info=True)
        return None
    try:
        text: Optional[str] = card_text(summary)  # rendered once: printed to a pipe as saved
    except Exception as exc:
        text = None
        log.debug("could not render the card: %s", exc)
    try:
        sys.stdout.flush()
        print_card(summary, text=text)
    except Exception as exc:  # a closed stdout must not cost the files
        log.debug("could not print the card: %s", exc)
    if run_dir is not None:  # the summary files first: on a full disk, the reserve is theirs
        rundir.release_reserve(run_dir)
        files = [(rundir.SUMMARY_JSON, lambda: json.dumps(summary, indent=2) + "\n")]
        if text is not None:
            files.append((rundir.SUMMARY_TXT, lambda: text))
        written = _write_files(run_dir, files)
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
            with contextlib.suppress(OSError):
                (run_dir / name).unlink()  # no half file
    return written
