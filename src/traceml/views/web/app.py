"""The web dashboard: a read-only Starlette app over one run, served by uvicorn on a thread.

It reads the run through report.run_source.RunSource: the store's series and, while the run
trains, the collector's live state (the same snapshot the terminal shows); a finished run's
findings come from its final_summary.json. The page's assets come from this package and from the installed
plotly package; only the names in ASSETS are ever served, so no path reaches the disk.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Dict, Mapping, Optional, Tuple

from traceml.report import queries
from traceml.rundir import RunDirError
from traceml.report.run_source import RunSource
from traceml.views.summary import adapter_text, phase_display

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    import uvicorn

log = logging.getLogger("traceml")

STATIC = Path(__file__).parent / "static"
STREAM_INTERVAL_S = 1.0
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


def worded_memory(memory: Dict[str, Any]) -> Dict[str, Any]:
    """The memory ledger with each rank's adapters in words (views.summary.adapter_text)."""
    for row in memory["ledger"]:
        adapters, parameters = row.pop("adapters"), row.pop("parameters")
        row["adapters"] = adapter_text(adapters, parameters) if adapters else None
    return memory


# -- the HTTP app ---------------------------------------------------------------------------------
def _int_param(request: Request, name: str, default: Optional[int], low: int, high: int) -> Optional[int]:
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


def create_app(source: RunSource) -> Starlette:
    """The Starlette app serving one run's page, assets, JSON API and live stream."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import (FileResponse, JSONResponse, PlainTextResponse, Response,
                                     StreamingResponse)
    from starlette.routing import Route

    max_step = 2 ** 62

    def api(handler: Callable[[Request], Mapping[str, object]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
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

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def asset(request: Request) -> Response:
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

    async def metrics(request: Request) -> Response:
        if registry is None or not source.live:
            return PlainTextResponse("no live run: /metrics is served while a run trains\n", status_code=404)
        from traceml.views.metrics import exposition

        return Response(**await run_in_threadpool(exposition, registry))

    async def stream(request: Request) -> Response:
        async def events() -> AsyncIterator[str]:
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
        Route("/api/timeline", api(lambda request: source.timeline(
            _int_param(request, "steps", 12, 1, queries.MAX_TIMELINE_STEPS)))),  # type: ignore[arg-type]  # a default
        Route("/api/system", api(lambda request: source.system(points(request)))),
        Route("/api/ranks", api(lambda request: source.ranks(points(request)))),
        Route("/api/layers", api(lambda request: source.layers())),
        Route("/api/spans", api(lambda request: source.spans())),
        Route("/api/memory", api(lambda request: worded_memory(source.memory()))),
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
        self.source, self.host, self.port = source, host, port
        self._server: Optional[uvicorn.Server] = None
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
    except RunDirError as exc:  # already the one line: no such directory, or no run in it
        raise OSError(str(exc)) from None
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
