"""`traceml compare`'s table: the comparison report/compare.py makes, printed with rich.

Numbers and paths are never cut: off a terminal the table takes the width it needs, and where a
width is imposed (a narrow terminal) the phases are laid out as lines that wrap between whole
figures instead of as a table whose cells would be cut.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, List, Optional, TextIO, Tuple

from traceml.report.compare import DISTURBED_PACE, DISTURBED_RUN_PACE, Comparison, EnvironmentRow, load_text

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
    from rich.table import Table
    from rich.text import Text

VERDICT_STYLE = {"IMPROVEMENT": "bold white on green", "REGRESSION": "bold white on red",
                 "EQUIVALENT": "bold white on blue", "INCONCLUSIVE": "bold black on yellow"}
GATE_STYLE = {"fail": "bold white on red", "pass": "bold white on green", "inconclusive": "bold black on yellow"}
TEXT_WIDTH = 80  # prose wraps here, off a terminal, unless the table or a path needs more
UNBOUNDED = 10_000  # columns: wide enough to measure anything unwrapped


def print_comparison(result: Comparison, file: Optional[TextIO] = None) -> None:
    """Print the comparison: on a terminal at its width; to a file or a pipe (which have no
    width, and rich would give them 80 columns) as wide as the table needs."""
    from rich.console import Console

    comparison = _Comparison(result)
    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, highlight=False, width=comparison.width_needed())
    console.print(comparison)


class _Comparison:
    """The verdict, the phase table (or, where it does not fit, the phases as wrapping lines),
    the diagnosis and the environment."""

    def __init__(self, result: Comparison):
        self.result = result

    def _parts(self, phases: RenderableType) -> List[RenderableType]:
        from rich.text import Text

        result = self.result
        head = Text.assemble(("Verdict ", "bold"), (f" {result['verdict']} ", VERDICT_STYLE[result["verdict"]]),
                             "  ", result["reason"])
        runs = _grid([("A", Text(result["a"])), ("B", Text(result["b"]))])
        diagnosis = result["diagnosis"]
        lines = [Text.assemble(("Diagnosis ", "bold"), f"{diagnosis['primary_a'] or 'none'} → "
                                                       f"{diagnosis['primary_b'] or 'none'}")]
        if diagnosis["gone"] or diagnosis["new"]:
            lines.append(Text(f"  gone: {', '.join(diagnosis['gone']) or '-'}   new: "
                              f"{', '.join(diagnosis['new']) or '-'}"))
        machine = result["machine"]
        if machine["busier"]:
            lines.append(Text.assemble(("Machine ", "bold"), (load_text(machine), "bold yellow")))
        if machine["stretches_left_out_a"] or machine["stretches_left_out_b"]:
            lines.append(Text.assemble(("Left out ", "bold"), (
                f"stretches run {DISTURBED_PACE:g}x slower than their run's pace (a neighbour's bursts): "
                f"A {machine['stretches_left_out_a']}, B {machine['stretches_left_out_b']}")))
        if machine["repeats_a"] > 1 or machine["repeats_b"] > 1:
            left_out = machine["repeats_left_out_a"] + machine["repeats_left_out_b"]
            lines.append(Text.assemble(("Repeats ", "bold"), f"A {machine['repeats_a']} runs, "
                                                             f"B {machine['repeats_b']} runs",
                                       (f"; left out, run {DISTURBED_RUN_PACE:g}x slower than their side's "
                                        f"pace: A {machine['repeats_left_out_a']}, "
                                        f"B {machine['repeats_left_out_b']}") if left_out else ""))
        parts: List[RenderableType] = [head, runs, Text(""), phases, *lines, Text(""), _environment(result["environment"])]
        if "gate" in result:
            gate = result["gate"]
            parts += [Text(""), Text.assemble(("Gate ", "bold"), (f" {gate['decision'].upper()} ",
                                                                  GATE_STYLE[gate["decision"]]),
                                              f"  {gate['reason']} (exit {gate['exit_code']})")]
        return parts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.measure import Measurement

        # The full table, else a compact one, else lines: the first whose unwrapped width fits
        # (measured unbounded: a measure within the width given never says it is too narrow).
        unbounded = options.update_width(UNBOUNDED)
        phases: RenderableType = next((table for table in (_phase_table(self.result), _phase_table(self.result, compact=True))
                       if Measurement.get(console, unbounded, table).maximum <= options.max_width),
                      _phase_lines(self.result))
        yield from self._parts(phases)

    def width_needed(self) -> int:
        """The columns the table takes unwrapped, and the longest word (a path) elsewhere."""
        from rich.console import Console
        from rich.measure import Measurement

        measure = Console(width=UNBOUNDED, file=io.StringIO())
        table = _phase_table(self.result)
        words = max(Measurement.get(measure, measure.options, part).minimum
                    for part in self._parts(table))
        return max(TEXT_WIDTH, Measurement.get(measure, measure.options, table).maximum, words)


def _rows(result: Comparison) -> List[Tuple[str, List[str]]]:
    """Each phase's label and figures, formatted once for the table and the lines alike."""
    from traceml.views.summary import PHASE_LABELS

    rows = []
    for name, row in [("step", result["step"])] + list(result["phases"].items()):
        interval = row["ci_ms"]
        share = row["delta_share"]
        rows.append((PHASE_LABELS[name], [
            f"{row['median_a_ms']:.2f}", f"{row['median_b_ms']:.2f}", f"{row['delta_ms']:+.2f}",
            # Past ±1000% the decimal says nothing: whole percents.
            "" if share is None else f"{share:+.0%}" if abs(share) >= 10 else f"{share:+.1%}",
            f"{interval[0]:+.2f} … {interval[1]:+.2f}" if interval else "n/a"]))
    return rows


def _interval_header(result: Comparison) -> str:
    return f"{result['confidence']:.0%} interval ms"


def _phase_table(result: Comparison, compact: bool = False) -> Table:
    """The phases' table; compact: short headers, and phase names that may wrap."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    headers = (["A ms", "B ms", "Δ ms", "Δ", f"{result['confidence']:.0%} CI ms"] if compact else
               ["A median ms", "B median ms", "Δ ms", "Δ", _interval_header(result)])
    table.add_column("phase", no_wrap=not compact, overflow="fold")
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)
    for label, figures in _rows(result):
        table.add_row(label, *figures)
    return table


def _phase_lines(result: Comparison) -> Table:
    """The phases where the table does not fit: a line each, wrapping between whole figures."""
    from rich.text import Text

    lines: List[Tuple[str, Text]] = []
    for label, (a_ms, b_ms, delta_ms, delta_share, interval) in _rows(result):
        change = f"Δ {delta_ms} ms" + (f" ({delta_share})" if delta_share else "")
        lines.append((label, Text(f"A {a_ms} ms  B {b_ms} ms  {change}  "
                                  f"{_interval_header(result)}: {interval}")))
    return _grid(lines)


def _environment(rows: List[EnvironmentRow]) -> Table:
    """What else differs: a field a line, A and B on lines of their own where they differ."""
    from rich.text import Text

    lines: List[Tuple[str, Text]] = []
    for row in rows:
        if row["differs"]:
            lines += [(row["field"], Text.assemble(("A  ", "bold"), (str(row["a"]), "bold yellow"))),
                      ("", Text.assemble(("B  ", "bold"), (str(row["b"]), "bold yellow")))]
        else:
            lines.append((row["field"], Text(str(row["a"]))))
    return _grid(lines, title="environment")


def _grid(rows: List[Tuple[str, Text]], title: str = "") -> Table:
    """Names beside values; a value wraps at spaces, and folds only a word wider than the line."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    if title:
        grid.title, grid.title_justify = title, "left"
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for name, value in rows:
        grid.add_row(name, value)
    return grid
