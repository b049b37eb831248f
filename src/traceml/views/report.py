"""report.html: a self-contained page (inline CSS and SVG, no network) with the run's charts."""
from __future__ import annotations

import html
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from traceml.records import ALL_PHASES, STEP_PHASES, RolledStep
from traceml.views.summary import PHASE_COLOURS, PHASE_LABELS, SEVERITY_COLOURS
from traceml.words import counted, every

if TYPE_CHECKING:
    from traceml.report.summary import FinalSummary, FindingDict, PhaseFigures, SpanFigures, Throughput

MAX_CHART_POINTS = 2000

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:960px;color:#222}
h1{font-size:1.4rem} h2{font-size:1.1rem;margin-top:2rem}
table{border-collapse:collapse} td,th{padding:.25rem .75rem;text-align:right;border-bottom:1px solid #ddd}
td:first-child,th:first-child{text-align:left}
.finding{border-left:4px solid #888;padding:.25rem .75rem;margin:.5rem 0}
.legend span{display:inline-block;margin-right:1rem}.swatch{width:.8rem;height:.8rem;display:inline-block}
.evidence span{display:inline-block;margin-right:1rem;font-size:.85rem;color:#555}
""" + "".join(f".{severity}{{border-color:{colour}}}" for severity, colour in SEVERITY_COLOURS.items())


def render_report(summary: FinalSummary, steps: Sequence[RolledStep]) -> str:
    run, phases = summary["run"], summary["phases"]
    shown = _evenly(steps)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>TraceML · {_e(run['script'])}</title><style>{_STYLE}</style></head><body>",
        f"<h1>TraceML · {_e(run['script'])}</h1>",
        f"<p>{counted(summary['steps']['count'], 'step')} · {run['duration_s']:.1f} s · exit code "
        f"{_e(run['exit_code'])} · world size {run['world_size']} · torch {_e(run['torch_version'])}"
        f"{_throughput_text(summary['throughput'])}</p>",
        "<h2>Diagnosis</h2>",
        *(_finding(f) for f in summary["findings"]),
        "<h2>Where step time goes</h2>",
        _phase_bar(phases),
        _phase_table(phases),
        *(["<h2>User spans</h2>", _span_table(summary["spans"])] if summary.get("spans") else []),
        "<h2>Step time over steps</h2>",
        _line_chart("step-chart", {"step (median rank)": [(s.step, s.step_ms) for s in shown],
                                   "slowest rank": [(s.step, s.worst_step_ms) for s in shown]
                                   if run["world_size"] > 1 else []}, unit="ms"),
        "<h2>Memory over steps</h2>",
        _memory_chart(summary, shown),
    ]
    if run["world_size"] > 1 and summary["rank_spread"]:
        parts += ["<h2>Across ranks</h2>", _rank_chart(summary), _rank_table(summary)]
    if summary["layers"]:
        parts += ["<h2>Layers (deep-dive)</h2>", _layer_table(summary)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _evenly(steps: Sequence[RolledStep]) -> List[RolledStep]:
    stride = max(1, -(-len(steps) // MAX_CHART_POINTS))
    return list(steps[::stride])


def _throughput_text(throughput: Throughput) -> str:
    text = f" · {throughput['steps_per_s']:.2f} steps/s"
    if throughput.get("samples_per_s"):
        text += f" · {throughput['samples_per_s']:,.1f} samples/s"
    if throughput.get("tokens_per_s"):
        text += f" · {throughput['tokens_per_s']:,.0f} tokens/s"
        if throughput.get("padding_share") is not None:
            text += f" ({throughput['padding_share']:.0%} padding)"
    return text


def _e(value: object) -> str:
    return html.escape(str(value))


def _finding(finding: FindingDict) -> str:
    evidence = "".join(f"<span><b>{_e(key)}</b> {_e(value)}</span>"
                       for key, value in finding.get("evidence", {}).items() if value is not None)
    return (f"<div class='finding {_e(finding['severity'])}' data-kind='{_e(finding['kind'])}'>"
            f"<b>{_e(finding['kind'])}</b> ({_e(finding['severity'])}"
            f"{', rank ' + _e(finding['rank']) if finding.get('rank') is not None else ''}): "
            f"{_e(finding['summary'])}<br><i>Next:</i> {_e(finding['action'])}"
            f"<div class='evidence'>{evidence}</div></div>")


def _phase_bar(phases: Dict[str, PhaseFigures], width: int = 900, height: int = 28) -> str:
    x = 0.0
    rects, legend = [], []
    for name in STEP_PHASES:
        share = phases[name]["share"]
        w = share * width
        rects.append(f"<rect x='{x:.1f}' y='0' width='{w:.1f}' height='{height}' "
                     f"fill='{PHASE_COLOURS[name]}'><title>{PHASE_LABELS[name]}: {share:.1%}</title></rect>")
        legend.append(f"<span><i class='swatch' style='background:{PHASE_COLOURS[name]}'></i> "
                      f"{PHASE_LABELS[name]} {share:.1%}</span>")
        x += w
    return (f"<svg id='phase-bar' width='{width}' height='{height}' role='img'>{''.join(rects)}</svg>"
            f"<p class='legend'>{''.join(legend)}</p>")


def _phase_table(phases: Dict[str, PhaseFigures]) -> str:
    rows = "".join(f"<tr><td>{PHASE_LABELS.get(name, name)}</td><td>{stats['median_ms']:.2f}</td>"
                   f"<td>{stats['mean_ms']:.2f}</td><td>{stats['share']:.1%}</td></tr>"
                   for name, stats in phases.items() if name != "step")
    return f"<table><tr><th>phase</th><th>median ms</th><th>mean ms</th><th>% of step</th></tr>{rows}</table>"


def _span_table(spans: Dict[str, SpanFigures]) -> str:
    """The user spans, as report/summary.py's span_figures defines their figures."""
    rows = "".join(f"<tr><td>{_e(name)}</td><td>{span['count']}</td><td>{span['steps']}</td>"
                   f"<td>{span['median_ms']:.2f}</td><td>{span['total_ms_per_step']:.2f}</td>"
                   f"<td>{span['share']:.1%}</td></tr>" for name, span in spans.items())
    return ("<p>Spans overlap the phases. Median: the span's time in a step it ran in; ms per step "
            "and % of step: over every measured step, warm-up left out.</p><table id='span-table'><tr>"
            "<th>span</th><th>calls</th><th>steps</th><th>median ms</th><th>ms per step</th>"
            f"<th>% of step</th></tr>{rows}</table>")


def _line_chart(chart_id: str, series: Dict[str, List[Tuple[float, float]]], unit: str,
                limits: Optional[Dict[str, float]] = None, width: int = 900, height: int = 240) -> str:
    """Lines over steps, with dashed horizontal limits (a capacity); inline SVG, no script."""
    series = {name: points for name, points in series.items() if points}
    limits = limits or {}
    if not series:
        return f"<p id='{chart_id}'>Nothing recorded.</p>"
    xs = [x for points in series.values() for x, _ in points]
    data_top = max(y for points in series.values() for _, y in points)
    # A limit far above the data (24 GiB of RAM for a 300 MiB process) would flatten the lines:
    # it is named in the legend instead of drawn.
    far = {name: value for name, value in limits.items() if value > 4 * data_top}
    limits = {name: value for name, value in limits.items() if name not in far}
    top = max([data_top] + list(limits.values())) or 1.0
    first, last = min(xs), max(max(xs), min(xs) + 1)
    left, bottom = 60, height - 24

    def at(x: float, y: float) -> str:
        return f"{left + (x - first) / (last - first) * (width - left - 10):.1f},{bottom - y / top * (bottom - 10):.1f}"

    colours = ["#4c78a8", "#e45756", "#54a24b", "#b279a2", "#f58518"]
    lines, legend = [], []
    for index, (name, points) in enumerate(series.items()):
        colour = colours[index % len(colours)]
        lines.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.3' "
                     f"points='{' '.join(at(x, y) for x, y in points)}'><title>{_e(name)}</title></polyline>")
        legend.append(f"<span><i class='swatch' style='background:{colour}'></i> {_e(name)}</span>")
    for name, value in limits.items():
        y = bottom - value / top * (bottom - 10)
        lines.append(f"<line x1='{left}' x2='{width - 10}' y1='{y:.1f}' y2='{y:.1f}' stroke='#d62728' "
                     f"stroke-dasharray='6 4'><title>{_e(name)}</title></line>")
        legend.append(f"<span><i class='swatch' style='background:#d62728'></i> {_e(name)} (dashed)</span>")
    for name, value in far.items():
        legend.append(f"<span>{_e(name)}: {value:,.0f} {unit}, far above</span>")
    return (f"<svg id='{chart_id}' width='{width}' height='{height}' role='img'>"
            f"<text x='0' y='14' font-size='11'>{top:,.1f} {unit}</text>"
            f"<text x='0' y='{bottom}' font-size='11'>0</text>"
            f"<text x='{left}' y='{height - 4}' font-size='11'>step {first:.0f}</text>"
            f"<text x='{width - 90}' y='{height - 4}' font-size='11'>step {last:.0f}</text>"
            f"{''.join(lines)}</svg><p class='legend'>{''.join(legend)}</p>")


def _memory_chart(summary: FinalSummary, steps: Sequence[RolledStep]) -> str:
    memory, mib = summary["memory"], 2 ** 20

    def series(field: str) -> List[Tuple[float, float]]:
        return [(s.step, getattr(s, field) / mib) for s in steps if getattr(s, field) is not None]

    device = {f"device {kind}": series(f"device_{kind}_bytes") for kind in ("allocated", "peak", "reserved")}
    host = {"host RSS": series("host_rss_bytes")}
    parts = []
    if any(device.values()):
        capacity = memory["device_capacity_bytes"]
        parts.append(_line_chart("memory-chart", device, "MiB",
                                 {"device capacity": capacity / mib} if capacity else None))
    ram = summary["system"].get("ram_total_bytes")
    parts.append(_line_chart("host-memory-chart" if parts else "memory-chart", host, "MiB",
                             {"node RAM": ram / mib} if ram and not parts else None))
    return "".join(parts)


def _rank_chart(summary: FinalSummary, width: int = 900, row: int = 18) -> str:
    """Per phase, the median rank's time against the worst rank's, as paired bars."""
    spread = {name: value for name, value in summary["rank_spread"].items() if name in ("step",) + ALL_PHASES}
    top = max((value["worst"] for value in spread.values()), default=0.0) or 1.0
    bars = []
    for index, (name, value) in enumerate(spread.items()):
        y = index * (2 * row + 6)
        label = PHASE_LABELS[name]
        for offset, (kind, colour) in enumerate((("median", "#4c78a8"), ("worst", "#e45756"))):
            length = value[kind] / top * (width - 260)  # type: ignore[literal-required]  # "median" or "worst"
            bars.append(f"<rect x='200' y='{y + offset * row}' width='{length:.1f}' height='{row - 3}' "
                        f"fill='{colour}'><title>{_e(label)} {kind}: {value[kind]:.2f} ms</title></rect>"  # type: ignore[literal-required]  # "median" or "worst"
                        f"<text x='{205 + length:.1f}' y='{y + offset * row + 12}' font-size='11'>"
                        f"{value[kind]:.2f} ms{' (rank ' + str(value['worst_rank']) + ')' if kind == 'worst' else ''}</text>")  # type: ignore[literal-required]  # "median" or "worst"
        bars.append(f"<text x='0' y='{y + row + 4}' font-size='12'>{_e(label)}</text>")
    height = len(spread) * (2 * row + 6)
    return (f"<svg id='rank-chart' width='{width}' height='{height}' role='img'>{''.join(bars)}</svg>"
            "<p class='legend'><span><i class='swatch' style='background:#4c78a8'></i> median rank</span>"
            "<span><i class='swatch' style='background:#e45756'></i> worst rank</span></p>")


def _rank_table(summary: FinalSummary) -> str:
    rows = "".join(f"<tr><td>{row['rank']}</td><td>{row['steps']}</td><td>{_ms(row['step_median_ms'])}</td>"
                   f"<td>{_ms(row['input_wait_median_ms'])}</td><td>{_ms(row['forward_median_ms'])}</td>"
                   f"<td>{_ms(row['backward_median_ms'])}</td><td>{_ms(row.get('comm_wait_median_ms'))}</td>"
                   f"<td>{row['behind_share']:.0%}</td></tr>" for row in summary["ranks"])
    return ("<table id='rank-table'><tr><th>rank</th><th>steps</th><th>step ms</th><th>input wait ms</th>"
            "<th>forward ms</th><th>backward ms</th><th>comm wait ms</th><th>waited for</th></tr>"
            f"{rows}</table>")


def _layer_table(summary: FinalSummary, limit: int = 25) -> str:
    deep = summary["deep_dive"]
    assert deep is not None  # layers come with the deep-dive that sampled them
    leaves = [row for row in summary["layers"] if row["leaf"]][:limit]
    rows = "".join(f"<tr><td>{_e(row['name'])} ({_e(row['type'])})</td><td>{row['calls_per_step']:.0f}</td>"
                   f"<td>{row['forward_ms']:.3f}</td><td>{row['backward_ms']:.3f}</td>"
                   f"<td>{row['memory_bytes'] / 2 ** 20:.2f}</td><td>{row['output_bytes'] / 2 ** 20:.2f}</td></tr>"
                   for row in leaves)
    coverage = deep.get("coverage_note") or (f"leaf modules cover {deep['forward_coverage']:.0%} of forward, "
                                             f"{deep['backward_coverage']:.0%} of backward")
    return (f"<p>Sampled {counted(deep['sampled_steps'], 'step')} ({every(deep['every_n_steps'], 'step')}); {_e(coverage)}. "
            f"Per step, slowest first.</p><table id='layer-table'><tr><th>layer</th><th>calls</th>"
            f"<th>forward ms</th><th>backward ms</th><th>saved MiB</th><th>output MiB</th></tr>{rows}</table>")


def _ms(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}"
