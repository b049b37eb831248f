"""`traceml compare`'s table: the comparison analysis/compare.py makes, printed with rich."""
from __future__ import annotations

from typing import Any, Dict

VERDICT_STYLE = {"IMPROVEMENT": "bold white on green", "REGRESSION": "bold white on red",
                 "EQUIVALENT": "bold white on blue", "INCONCLUSIVE": "bold black on yellow"}


def render(result: Dict[str, Any]) -> Any:
    """The comparison as a rich renderable."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from traceml.views.summary import PHASE_LABELS

    head = Text.assemble(("Verdict ", "bold"), (f" {result['verdict']} ", VERDICT_STYLE[result["verdict"]]),
                         "  ", result["reason"])
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), title=f"A: {result['a']}   B: {result['b']}",
                  title_justify="left")
    for header in ("phase", "A median ms", "B median ms", "Δ ms", "Δ", f"{result['confidence']:.0%} interval ms"):
        table.add_column(header, justify="left" if header == "phase" else "right", no_wrap=True)
    rows = [("step", result["step"])] + list(result["phases"].items())
    for name, row in rows:
        interval = row["ci_ms"]
        table.add_row(PHASE_LABELS[name], f"{row['median_a_ms']:.2f}", f"{row['median_b_ms']:.2f}",
                      f"{row['delta_ms']:+.2f}",
                      f"{row['delta_share']:+.1%}" if row["delta_share"] is not None else "",
                      f"{interval[0]:+.2f} … {interval[1]:+.2f}" if interval else "n/a")
    diagnosis = result["diagnosis"]
    lines = [Text.assemble(("Diagnosis ", "bold"), f"{diagnosis['primary_a'] or 'none'} → "
                                                   f"{diagnosis['primary_b'] or 'none'}")]
    if diagnosis["gone"] or diagnosis["new"]:
        lines.append(Text(f"  gone: {', '.join(diagnosis['gone']) or '-'}   new: "
                          f"{', '.join(diagnosis['new']) or '-'}"))
    env = Table(box=box.SIMPLE_HEAD, padding=(0, 1), title="environment", title_justify="left")
    for header in ("", "A", "B"):
        env.add_column(header, overflow="fold")
    for row in result["environment"]:
        style = "bold yellow" if row["differs"] else ""
        env.add_row(row["field"], str(row["a"]), str(row["b"]), style=style)
    return Group(head, table, *lines, env)
