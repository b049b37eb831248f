"""The web dashboard: a read-only Starlette app over one run, served by uvicorn on a thread.

It reads the run's store (its own read-only SQLite connection) and, while the run trains, the
collector's live state (the same snapshot the terminal shows); a finished run is read from
its final_summary.json. The page's assets come from this package and from the installed
plotly package; only the names in ASSETS are ever served, so no path reaches the disk.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from traceml import rundir
from traceml.analysis.ledger import LEDGER_PARTS, PART_WORDS, ledger_history, part_bytes
from traceml.analysis.live import snapshot
from traceml.analysis.rollup import comm_wait_parts, warmup_steps
from traceml.analysis.summary import RunData, RunFacts, build_summary, deep_dive_figures, device_names
from traceml.collector.store import Store
from traceml.records import ALL_PHASES
from traceml.views.summary import adapter_text, phase_display, straggler_finding, straggler_rank
from traceml.views.web import queries

log = logging.getLogger("traceml")

STATIC = Path(__file__).parent / "static"
STREAM_INTERVAL_S = 1.0
LIVE_STATE_S = 0.5
DEFAULT_POINTS = 1000
PORT_ATTEMPTS = 20  # a taken port moves on to the next, this many times


def _plotly_js() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the plotly package is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "package_data" / "plotly.min.js"


ASSETS: Dict[str, Tuple[Callable[[], Path], str]] = {
    "app.js": (lambda: STATIC / "app.js", "text/javascript"),
    "style.css": (lambda: STATIC / "style.css", "text/css"),
    "plotly.min.js": (_plotly_js, "text/javascript"),
}


class BadRequest(ValueError):
    """A query parameter that is not what the API takes: answered with a 400."""


class RunSource:
    """One run as the dashboard sees it: its store, and while it trains, its collector."""

    def __init__(self, run_dir: Path, store: Store, collector: Any = None, script: str = "",
                 started_at_unix_s: Optional[float] = None):
        self.run_dir = run_dir
        self.store = store
        self.collector = collector  # None for `traceml view`
        self.script = script
        self.started_at_unix_s = started_at_unix_s or time.time()
        self.summary: Optional[Dict[str, Any]] = None  # once the run is over
        self._alerts: List[Any] = []
        # Whole-run buckets, kept between requests: a refresh reads only the newest rows.
        self._steps = queries.step_buckets(store)
        self._own_time = queries.own_time_buckets(store)
        self._spans = queries.span_buckets(store)
        self._scalars = queries.scalar_buckets(store)
        self._lock = threading.Lock()  # the caches are shared by the request threads
        self._state: Any = None  # the latest live snapshot, and when it was taken
        self._state_at = 0.0

    @classmethod
    def of_finished_run(cls, run_dir: Path) -> "RunSource":
        """A run directory on disk: its store, read-only, and its summary."""
        store_path = run_dir / rundir.STORE_NAME
        if not store_path.is_file():
            raise FileNotFoundError(f"{run_dir} holds no {rundir.STORE_NAME}: not a TraceML run directory")
        source = cls(run_dir, Store(os.fspath(store_path), readonly=True))
        summary_path = run_dir / rundir.SUMMARY_JSON
        try:
            source.summary = json.loads(summary_path.read_text())
        except (OSError, ValueError):  # a run cut short: summarize what the store holds
            source.summary = build_summary(RunData(source.store), RunFacts.from_store(source.store))
        source.script = source.summary["run"]["script"]
        return source

    @classmethod
    def of_live_run(cls, run_dir: Optional[Path], store: Store, collector: Any, script: str,
                    started_at_unix_s: float) -> "RunSource":
        """A run in progress: a read-only connection of our own to the collector's store (an
        in-memory store, when the run dir cannot be written, is shared under its lock)."""
        reader = store if store.path == ":memory:" else Store(store.path, readonly=True)
        return cls(run_dir or Path("."), reader, collector, script, started_at_unix_s)

    def live_state(self) -> Any:
        """The collector's live state, diagnosed at most every LIVE_STATE_S however many pages
        and endpoints ask: the rules run in the collector's process, beside the ingest."""
        with self._lock:
            now = time.monotonic()
            if self._state is None or now - self._state_at >= LIVE_STATE_S:
                self._state = snapshot(self.collector, self.script,
                                       time.time() - self.started_at_unix_s, self._alerts)
                self._state_at = now
            return self._state

    def close(self) -> None:
        """Close our own read-only connection (never the collector's store we were lent)."""
        if self.store.readonly:
            self.store.close()

    @property
    def live(self) -> bool:
        return self.collector is not None and self.summary is None

    # -- what the endpoints answer ---------------------------------------------------------
    def overview(self) -> Dict[str, Any]:
        if not self.live:
            return _overview_of_summary(self.summary or {}, os.fspath(self.run_dir))
        state = self.live_state()
        elapsed_s = state.elapsed_s
        window = state.window
        findings = [_finding(f) for f in state.findings]
        return {
            "live": True, "script": self.script, "run_dir": os.fspath(self.run_dir),
            "elapsed_s": elapsed_s, "steps_seen": state.steps_seen, "world_size": state.world_size,
            "devices": device_names(list(self.collector.hellos.values())),
            "step": {"median_ms": window.step_median_ms, "p90_ms": window.step_p90_ms},
            "throughput": {"steps_per_s": window.steps_per_s, "samples_per_s": window.samples_per_s},
            "phases": {name: {"median_ms": stats.median_ms, "mean_ms": stats.mean_ms,
                              "share": stats.share} for name, stats in window.phases.items()},
            "goodput": state.goodput.parts if state.goodput is not None else None,
            "primary": findings[0] if findings else None, "findings": findings, "exit_code": None,
        }

    def steps(self, start: Optional[int], end: Optional[int], points: int) -> Dict[str, Any]:
        capacity = self._capacity()
        if start is None and end is None:
            with self._lock:
                self._steps.refresh()
                series = queries.step_series(self._steps.coarsen(points), capacity)
            series["warmup_steps"] = self.warmup_steps()
            return series
        known = queries.step_range(self.store) or (0, -1)
        first = known[0] if start is None else max(start, known[0])
        last = known[1] if end is None else min(end, known[1])
        zoomed = queries.step_buckets(self.store).read_range(first, last, points)
        return queries.step_series(zoomed, capacity)

    def system(self, points: int) -> Dict[str, Any]:
        series = queries.system_series(self.store, points)
        latest = self.store.latest_system()  # the buckets' means do not carry the CPU count
        series["cpu_count"] = latest.cpu_count if latest is not None and latest.cpu_count else None
        return series

    def ranks(self, points: int) -> Dict[str, Any]:
        if self.live:
            state = self.live_state()
            rows, spread, findings = state.ranks, state.spread, state.findings
        else:
            summary = self.summary or {}
            rows, spread = summary.get("ranks", []), summary.get("rank_spread", {})
            findings = summary.get("findings", [])
        straggler = straggler_finding(findings)
        with self._lock:
            self._own_time.refresh()
            heatmap = queries.rank_heatmap(self._own_time.coarsen(points))
        # Each rank's comm wait by phase, as the card splits it: the page keeps no arithmetic of its own.
        rows = [{**row, "comm_wait_parts": comm_wait_parts(row)} for row in rows]
        return {"ranks": rows, "spread": spread, "straggler": straggler_rank(findings),
                "straggler_summary": _finding(straggler)["summary"] if straggler is not None else None,
                "heatmap": heatmap, "warmup_steps": self.warmup_steps()}

    def warmup_steps(self) -> int:
        """The first steps the summary leaves out as warm-up: the charts scale without them."""
        if self.live:
            return warmup_steps(self.live_state().steps_seen)
        return (self.summary or {}).get("steps", {}).get("warmup_excluded", 0)

    def layers(self) -> Dict[str, Any]:
        if not self.live:
            summary = self.summary or {}
            return {"deep_dive": summary.get("deep_dive"), "layers": summary.get("layers", [])}
        return deep_dive_figures(self.collector.latest_layers)

    def memory(self) -> Dict[str, Any]:
        """The memory ledger: each rank's parts now (bytes by analysis.ledger.LEDGER_PARTS, the
        parts not measured left out), and every reading's counted parts over steps."""
        if self.live:
            rows = self.live_state().ledger
            history = ledger_history(list(self.collector.ledgers))
        else:
            memory = (self.summary or {}).get("memory") or {}
            rows, history = memory.get("ledger") or [], memory.get("ledger_history") or []
        return {"parts": list(LEDGER_PARTS), "words": PART_WORDS, "history": history,
                "ledger": [{"rank": row["rank"], "parts": part_bytes(row), "held": row["held"],
                            "measured_on": row["measured_on"], "activations_step": row["activations_step"],
                            "adapters": (adapter_text(row["adapters"], row["parameters"])
                                         if row.get("adapters") else None)} for row in rows]}

    def spans(self) -> Dict[str, Any]:
        with self._lock:
            self._steps.refresh()
            self._spans.refresh()
            return queries.span_table(self._spans, queries.training_ms(self._steps))

    def scalars(self, points: int) -> Dict[str, Any]:
        with self._lock:
            self._scalars.refresh()
            return queries.scalar_series(self._scalars.coarsen(points))

    def _capacity(self) -> Dict[str, Optional[int]]:
        """The lines memory is drawn against: the largest device, and the node's RAM."""
        if self.live:
            hellos = list(self.collector.hellos.values())
            system = self.collector.latest_system
            host = system.ram_total_bytes if system is not None else None
        else:
            hellos = self.store.hellos()
            latest = self.store.latest_system()
            host = latest.ram_total_bytes if latest is not None else None
        device = max((h.device_capacity_bytes for h in hellos if h.device_capacity_bytes), default=None)
        return {"device_bytes": device, "host_bytes": host}


def _finding(finding: Any) -> Dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(finding)


def _overview_of_summary(summary: Dict[str, Any], run_dir: str) -> Dict[str, Any]:
    run, phases = summary.get("run", {}), summary.get("phases", {})
    step = phases.get("step", {})
    return {
        "live": False, "script": run.get("script", ""), "run_dir": run_dir,
        "elapsed_s": run.get("duration_s", 0.0), "steps_seen": summary.get("steps", {}).get("count", 0),
        "world_size": run.get("world_size", 1), "devices": run.get("devices", []),
        "step": {"median_ms": step.get("median_ms", 0.0), "p90_ms": step.get("p90_ms", 0.0)},
        "throughput": summary.get("throughput", {"steps_per_s": 0.0, "samples_per_s": None}),
        "phases": {name: phases[name] for name in ALL_PHASES if name in phases},
        "goodput": summary.get("goodput"),
        "primary": summary.get("primary_diagnosis"), "findings": summary.get("findings", []),
        "exit_code": run.get("exit_code"),
    }


# -- the HTTP app ---------------------------------------------------------------------------------
def _int_param(request: Any, name: str, default: Optional[int], low: int, high: int) -> Optional[int]:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, not {raw[:40]!r}") from None
    if not low <= value <= high:
        raise BadRequest(f"{name} must be between {low} and {high}")
    return value


def create_app(source: RunSource) -> Any:
    """The Starlette app serving one run's page, assets, JSON API and live stream."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import (FileResponse, JSONResponse, PlainTextResponse, Response,
                                     StreamingResponse)
    from starlette.routing import Route

    max_step = 2 ** 62

    def api(handler: Callable[[Request], Dict[str, Any]]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Any:
            try:
                body = await run_in_threadpool(handler, request)
            except BadRequest as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            except Exception as exc:  # a view's fault: this request fails, the run goes on
                log.warning("traceml: web request %s failed: %s", request.url.path, exc, exc_info=True)
                return JSONResponse({"error": "internal error"}, status_code=500)
            return JSONResponse(body, headers={"Cache-Control": "no-store"})
        return endpoint

    def points(request: Request) -> int:
        return _int_param(request, "points", DEFAULT_POINTS, 1, queries.MAX_POINTS)  # type: ignore[return-value]

    async def page(request: Request) -> Any:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def asset(request: Request) -> Any:
        entry = ASSETS.get(request.path_params["name"])
        if entry is None:
            return PlainTextResponse("not found", status_code=404)
        locate, media_type = entry
        try:
            path = locate()
        except FileNotFoundError as exc:
            return PlainTextResponse(str(exc), status_code=404)
        return FileResponse(path, media_type=media_type, headers={"Cache-Control": "max-age=3600"})

    registry = None
    if source.collector is not None:
        from traceml.views.metrics import registry_for

        registry = registry_for(source.collector, source.live_state)

    async def metrics(request: Request) -> Any:
        if registry is None or not source.live:
            return PlainTextResponse("no live run: /metrics is served while a run trains\n", status_code=404)
        from traceml.views.metrics import exposition

        return Response(**await run_in_threadpool(exposition, registry))

    async def stream(request: Request) -> Any:
        async def events() -> Any:
            while True:
                overview = await run_in_threadpool(source.overview)
                yield f"event: overview\ndata: {json.dumps(overview)}\n\n"
                if not overview["live"]:
                    yield "event: end\ndata: {}\n\n"
                    return
                await asyncio.sleep(STREAM_INTERVAL_S)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    routes = [
        Route("/", page),
        Route("/assets/{name}", asset),
        Route("/api/phases", api(lambda request: phase_display())),
        Route("/api/overview", api(lambda request: source.overview())),
        Route("/api/steps", api(lambda request: source.steps(
            _int_param(request, "start", None, 0, max_step), _int_param(request, "end", None, 0, max_step),
            points(request)))),
        Route("/api/timeline", api(lambda request: queries.timeline(
            source.store, _int_param(request, "steps", 12, 1, queries.MAX_TIMELINE_STEPS)))),
        Route("/api/system", api(lambda request: source.system(points(request)))),
        Route("/api/ranks", api(lambda request: source.ranks(points(request)))),
        Route("/api/layers", api(lambda request: source.layers())),
        Route("/api/spans", api(lambda request: source.spans())),
        Route("/api/memory", api(lambda request: source.memory())),
        Route("/api/scalars", api(lambda request: source.scalars(points(request)))),
        Route("/api/stream", stream),
        Route("/metrics", metrics),
    ]
    return Starlette(routes=routes)


# -- serving it -----------------------------------------------------------------------------------
class PortInUse(OSError):
    """No port to serve the dashboard on, from the one asked and the next ones after it."""


def bind_socket(host: str, port: int, attempts: int = PORT_ATTEMPTS) -> Tuple[socket.socket, Optional[str]]:
    """A listening socket on `port`, or on the next free one after it; with a note when moved.

    Port 0 asks the system for any free port."""
    first_error: Optional[OSError] = None
    for candidate in ([0] if port == 0 else range(port, min(port + attempts, 65536))):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            first_error = first_error or exc
            continue
        note = None if candidate == port or port == 0 else (
            f"port {port} is in use; the dashboard is on port {candidate} instead")
        return sock, note
    raise PortInUse(f"no free port from {port} to {port + attempts - 1} on {host}: {first_error}")


class WebServer:
    """uvicorn serving the dashboard app on a background thread."""

    def __init__(self, source: RunSource, host: str = "127.0.0.1", port: int = 0):
        self.source = source
        self.host = host
        self.port = port
        self._server: Any = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> Optional[str]:
        """Bind and serve; returns a note when the asked port was taken. Raises PortInUse."""
        import uvicorn

        sock, note = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.source), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = server = uvicorn.Server(config)

        def serve() -> None:
            try:  # off the main thread, uvicorn leaves the process's signal handlers alone
                asyncio.run(server.serve(sockets=[sock]))
            except Exception:
                log.warning("traceml: the web dashboard stopped", exc_info=True)

        self._thread = threading.Thread(target=serve, name="traceml-web", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return note

    def stop(self, timeout_s: float = 3.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.source.close()


def serve_run(source: RunSource, host: str, port: int, announce: Callable[[str], None]) -> WebServer:
    """Start the dashboard and say where it is; raises PortInUse when no port is free."""
    server = WebServer(source, host, port)
    note = server.start()
    if note:
        announce(f"traceml: {note}")
    announce(f"traceml: dashboard at {server.url}")
    return server


def view_finished_run(run_dir: Path, host: str, port: int, announce: Callable[[str], None]) -> None:
    """`traceml view`: serve a finished run's directory, read-only, until Ctrl-C or SIGTERM;
    raises OSError with the one line to say when it cannot."""
    import signal

    try:
        source = RunSource.of_finished_run(run_dir)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot open {run_dir}: {exc}") from None
    except Exception as exc:  # a store SQLite cannot read
        raise OSError(f"cannot read the run in {run_dir}: {exc}") from None
    try:
        web = serve_run(source, host, port, announce)
    except (PortInUse, OSError) as exc:
        raise OSError(f"cannot serve the dashboard: {exc}") from None
    announce("traceml: serving until Ctrl-C")
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
