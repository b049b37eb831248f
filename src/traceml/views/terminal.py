"""The live terminal dashboard: a rich Live view of the collector's recent state, redrawn every
half second below the script's own output, which passes through a pseudo-terminal.

`snapshot` reads the collector (never the training process); `render` is a pure function of
that snapshot and the terminal's size, so it is tested on synthetic state; `Dashboard` runs
the two, and forwards the script's output above the live panel so the redraw never garbles it.
"""
from __future__ import annotations

import codecs
import contextlib
import io
import os
import select
import statistics
import time
from typing import TYPE_CHECKING, List, Optional, Protocol, Tuple

from traceml.diagnose.stragglers import straggler_rank
from traceml.records import ALL_PHASES, STEP_PHASES, Finding
from traceml.report.live import LiveState, snapshot
from traceml.report.deep_dive import layer_rows
from traceml.views.summary import PHASE_LABELS, SEVERITY_STYLE, goodput_text
from traceml.words import counted

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.live import Live
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from traceml.report.live import Collector

REFRESH_S = 0.5
WIDE_COLUMNS = 100  # at this width and above, panels sit two by two
SPARK = "▁▂▃▄▅▆▇█"
GIB = 2 ** 30


# -- rendering ----------------------------------------------------------------------------------
def sparkline(values: List[float], width: int) -> str:
    values = values[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * (len(SPARK) - 1)))] for v in values)


def render(state: LiveState, width: int, height: int) -> RenderableType:
    """The dashboard for a terminal of this size: panels that do not fit are dropped, not
    wrapped, in the order least needed first."""
    from rich.console import Console, Group
    from rich.table import Table

    measure = Console(width=width, height=height, file=io.StringIO(), color_system=None)
    header = _header(state)
    panels = {"steps": _step_panel(state, width), "phases": _phase_panel(state),
              "memory": _memory_panel(state, width), "system": _system_panel(state)}
    if state.world_size > 1 and state.ranks:
        panels["ranks"] = _rank_panel(state)
    if state.layers is not None and state.layers.layers:
        panels["layers"] = _layer_panel(state)
    panels["alerts"] = _alert_panel(state)
    drop_order = [name for name in ("layers", "system", "ranks", "memory", "alerts", "steps") if name in panels]
    per_row = 2 if width >= WIDE_COLUMNS else 1
    while True:
        shown = list(panels.values())
        body = []
        for row in (shown[i:i + per_row] for i in range(0, len(shown), per_row)):
            if len(row) == 1:
                body.append(row[0])
                continue
            grid = Table.grid(expand=True, padding=(0, 1))
            grid.add_column(ratio=1)
            grid.add_column(ratio=1)
            grid.add_row(*row)
            body.append(grid)
        dashboard = Group(header, *body)
        # Measured, not estimated: a panel taller than the terminal would scroll the redraw.
        if len(measure.render_lines(dashboard, pad=False)) <= height or not drop_order:
            return dashboard
        del panels[drop_order.pop(0)]


def _panel(title: str, body: RenderableType) -> Panel:
    from rich.panel import Panel

    return Panel(body, title=title, title_align="left", padding=(0, 1))


def _four_columns() -> Table:
    from rich.table import Table

    table = Table.grid(padding=(0, 1))
    for _ in range(4):
        table.add_column()
    return table


def _spark_width(width: int) -> int:
    """A panel's sparkline: its panel's width (half the terminal when panels sit two by two)."""
    return max(10, (width // 2 if width >= WIDE_COLUMNS else width) - 8)


def _header(state: LiveState) -> RenderableType:
    from rich.text import Text

    window = state.window
    elapsed = time.strftime("%H:%M:%S", time.gmtime(state.elapsed_s))
    text = Text.assemble(("TraceML", "bold"), f" · {state.script} · {elapsed} · step {state.steps_seen:,}"
                         f" · {window.steps_per_s:,.1f} steps/s")
    if window.samples_per_s:
        text.append(f" · {window.samples_per_s:,.0f} samples/s")
    primary = next(iter(state.findings), None)
    if primary is not None:
        text.append("  ")
        text.append(f" {primary.kind} ", style=SEVERITY_STYLE[primary.severity])
    return text


def _step_panel(state: LiveState, width: int) -> RenderableType:
    from rich.text import Text

    window = state.window
    times = [s.step_ms for s in window.steps]
    body = Text(f"median {window.step_median_ms:.1f} ms   p90 {window.step_p90_ms:.1f} ms")
    if state.goodput is not None:  # the run's wall time so far: how much of it was training
        body.append(f"   goodput {goodput_text(state.goodput.parts)}")
    body.append("\n")
    body.append(sparkline(times, _spark_width(width)), style="cyan")
    return _panel(f"step time (last {counted(len(window), 'step')})", body)


def _phase_panel(state: LiveState) -> RenderableType:
    from rich.text import Text

    table = _four_columns()
    for name in ALL_PHASES:
        stats = state.window.phases[name]
        bar = "█" * int(round(stats.share * 20)) if name in STEP_PHASES else ""
        table.add_row(PHASE_LABELS[name], Text(f"{stats.median_ms:8.2f} ms", justify="right"),
                      Text(f"{stats.share:6.1%}", justify="right"), Text(bar, style="cyan"))
    return _panel("phases (median, % of step)", table)


def _memory_panel(state: LiveState, width: int) -> RenderableType:
    from rich.text import Text

    steps = state.window.steps
    last = steps[-1] if steps else None
    lines = Text()
    if last is not None and last.device_allocated_bytes is not None:
        capacity = state.limits.device_capacity_bytes
        lines.append(f"device allocated {last.device_allocated_bytes / GIB:.2f} GiB  peak "
                     f"{(last.device_peak_bytes or 0) / GIB:.2f}  reserved "
                     f"{(last.device_reserved_bytes or 0) / GIB:.2f}"
                     + (f"  of {capacity / GIB:.1f} GiB" if capacity else "") + "\n")
    if last is not None and last.host_rss_bytes:
        lines.append(f"host RSS {last.host_rss_bytes / 2 ** 20:,.0f} MiB\n")
    trend = state.window.memory_trend
    lines.append(f"trend {trend.bytes_per_step / 1024:+,.1f} KiB/step  ")
    lines.append(sparkline([float(v) for v in trend.held_bytes], _spark_width(width) - 28), style="magenta")
    return _panel("memory", lines)


def _system_panel(state: LiveState) -> RenderableType:
    from rich.text import Text

    system = state.system
    if system is None:
        return _panel("system", Text("waiting for the first sample"))
    lines = Text(f"CPU {system.cpu_percent:.0f}%  training {system.training_cpu_percent:.0f}%  RAM "
                 f"{system.ram_used_bytes / GIB:.1f} of {system.ram_total_bytes / GIB:.1f} GiB")
    for gpu in system.gpus:
        lines.append(f"\nGPU{gpu.index} {gpu.utilization_percent:.0f}%  "
                     f"{gpu.memory_used_bytes / GIB:.1f}/{gpu.memory_total_bytes / GIB:.0f} GiB")
        if gpu.temperature_c is not None:
            lines.append(f"  {gpu.temperature_c:.0f}°C")
        if gpu.power_w is not None:
            lines.append(f"  {gpu.power_w:.0f} W")
    return _panel("system", lines)


def _rank_panel(state: LiveState) -> RenderableType:
    straggler = straggler_rank(state.findings)
    ranks = state.ranks
    table = _four_columns()
    for name in ("step", "input_wait", "forward", "comm_wait"):
        key = f"{name}_median_ms"
        values = [(r[key], r["rank"]) for r in ranks if r[key] is not None]  # type: ignore[literal-required]  # the phase medians, by name
        if not values:
            continue
        worst, worst_rank = max(values)
        median = statistics.median(v for v, _ in values)
        who = f"[bold red]rank {worst_rank}[/]" if worst_rank == straggler else f"rank {worst_rank}"
        table.add_row(PHASE_LABELS[name], f"median {median:.2f} ms", f"worst {worst:.2f} ms", who)
    return _panel(f"ranks ({len(ranks)})", table)


def _layer_panel(state: LiveState) -> RenderableType:
    leaves = [row for row in layer_rows(state.layers) if row["leaf"]][:5]  # type: ignore[arg-type]  # shown with a deep-dive; the slowest first
    table = _four_columns()
    for row in leaves:
        table.add_row(row["name"][:30], f"fwd {row['forward_ms']:.2f} ms", f"bwd {row['backward_ms']:.2f} ms",
                      f"saved {row['memory_bytes'] / 2 ** 20:.1f} MiB")
    return _panel("top layers (deep-dive)", table)


def _alert_panel(state: LiveState) -> RenderableType:
    from rich.text import Text

    if not state.alerts:
        return _panel("alerts", Text("none so far"))
    lines = Text()
    for index, (at_s, finding) in enumerate(state.alerts[-4:]):
        if index:
            lines.append("\n")
        lines.append(f"{time.strftime('%H:%M:%S', time.gmtime(at_s))} ")
        lines.append(finding.kind, style=SEVERITY_STYLE[finding.severity])
        lines.append(f" {finding.summary}")
    return _panel("alerts", lines)


# -- running it ---------------------------------------------------------------------------------
class _Script(Protocol):
    """What runs the script (launcher.Script): a process, or a fork, that may have exited."""

    def poll(self) -> Optional[int]: ...


class Dashboard:
    """Runs the live view while the script runs, its output passing above the panel."""

    def __init__(self, collector: Collector, script: str, console: Optional[Console] = None):
        from rich.console import Console

        self.collector, self.script = collector, script
        self.console = console or Console(highlight=False)
        self.alerts: List[Tuple[float, Finding]] = []
        self._started = time.monotonic()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""
        self._terminal_size = b""

    def run(self, child: _Script, output_fd: int) -> None:
        """Until the script exits and its output is drained."""
        from rich.live import Live

        with Live(self._render(), console=self.console, auto_refresh=False, transient=True,
                  redirect_stdout=False, redirect_stderr=False) as live:
            next_draw = 0.0
            open_fd: Optional[int] = output_fd
            while open_fd is not None or child.poll() is None:
                if open_fd is not None:
                    readable, _, _ = select.select([open_fd], [], [], REFRESH_S / 2)
                    if readable:
                        try:
                            chunk = os.read(open_fd, 65536)
                        except OSError:  # EIO: the script and its children closed the terminal
                            chunk = b""
                        if not chunk:
                            open_fd = None
                        else:
                            self._forward(live, chunk)
                else:
                    time.sleep(REFRESH_S / 2)
                if time.monotonic() >= next_draw:
                    live.update(self._render(), refresh=True)
                    next_draw = time.monotonic() + REFRESH_S
                    if open_fd is not None:
                        self._pass_on_resize(open_fd)
            if self._partial:
                live.console.print(_from_ansi(self._partial))

    def _pass_on_resize(self, terminal_fd: int) -> None:
        """Give the script's terminal our terminal's size when it changes (it gets SIGWINCH)."""
        with contextlib.suppress(OSError, ValueError, AttributeError, ImportError):
            import fcntl
            import termios

            size = fcntl.ioctl(self.console.file.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
            if size != self._terminal_size:
                self._terminal_size = size
                fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, size)

    def _forward(self, live: Live, chunk: bytes) -> None:
        text = self._partial + self._decoder.decode(chunk)
        *lines, self._partial = text.split("\n")
        for line in lines:
            # A progress bar redraws its line with \r: show what it says last.
            live.console.print(_from_ansi(line.rstrip("\r").rsplit("\r", 1)[-1]))

    def _render(self) -> RenderableType:
        state = snapshot(self.collector, self.script, time.monotonic() - self._started, self.alerts)
        try:  # the terminal's size now: a resize takes effect at the next redraw
            columns, lines = os.get_terminal_size(self.console.file.fileno())
        except (OSError, ValueError, AttributeError):
            columns, lines = self.console.size
        # One column short of the edge: a line that fills it leaves some terminals waiting to
        # wrap, and the next redraw lands a line lower.
        self.console.width = max(20, columns - 1)
        return render(state, self.console.width, max(8, lines - 2))


def _from_ansi(line: str) -> Text:
    from rich.text import Text

    return Text.from_ansi(line, end="")
