"""report.html: a self-contained page (inline CSS and SVG, no network) with the run's charts."""
from __future__ import annotations

import html
from typing import Any, Dict, List, Sequence

from traceml.collector.rollup import RolledStep
from traceml.records import STEP_PHASES
from traceml.views.summary import PHASE_LABELS

PHASE_COLOURS = {"input_wait": "#e45756", "outside": "#9d9da1", "h2d": "#f58518", "forward": "#4c78a8",
                 "backward": "#72b7b2", "optimizer": "#54a24b", "untraced": "#b279a2", "gc": "#eeca3b"}
MAX_CHART_POINTS = 2000

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:960px;color:#222}
h1{font-size:1.4rem} h2{font-size:1.1rem;margin-top:2rem}
table{border-collapse:collapse} td,th{padding:.25rem .75rem;text-align:right;border-bottom:1px solid #ddd}
td:first-child,th:first-child{text-align:left}
.finding{border-left:4px solid #888;padding:.25rem .75rem;margin:.5rem 0}
.crit{border-color:#d62728}.warn{border-color:#e8a317}.info{border-color:#4c78a8}
.legend span{display:inline-block;margin-right:1rem}.swatch{width:.8rem;height:.8rem;display:inline-block}
"""


def render_report(summary: Dict[str, Any], steps: Sequence[RolledStep]) -> str:
    run, phases = summary["run"], summary["phases"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>TraceML · {_e(run['script'])}</title><style>{_STYLE}</style></head><body>",
        f"<h1>TraceML · {_e(run['script'])}</h1>",
        f"<p>{summary['steps']['count']} steps · {run['duration_s']:.1f} s · exit code "
        f"{_e(run['exit_code'])} · world size {run['world_size']} · torch {_e(run['torch_version'])}</p>",
        "<h2>Diagnosis</h2>",
        *(_finding(f) for f in summary["findings"]),
        "<h2>Where step time goes</h2>",
        _phase_bar(phases),
        _phase_table(phases),
        "<h2>Step time over steps</h2>",
        _step_chart(steps),
        "</body></html>",
    ]
    return "\n".join(parts)


def _e(value: Any) -> str:
    return html.escape(str(value))


def _finding(finding: Dict[str, Any]) -> str:
    return (f"<div class='finding {_e(finding['severity'])}'><b>{_e(finding['kind'])}</b> "
            f"({_e(finding['severity'])}): {_e(finding['summary'])}<br><i>Next:</i> "
            f"{_e(finding['action'])}</div>")


def _phase_bar(phases: Dict[str, Any], width: int = 900, height: int = 28) -> str:
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


def _phase_table(phases: Dict[str, Any]) -> str:
    rows = "".join(f"<tr><td>{PHASE_LABELS.get(name, name)}</td><td>{stats['median_ms']:.2f}</td>"
                   f"<td>{stats['mean_ms']:.2f}</td><td>{stats['share']:.1%}</td></tr>"
                   for name, stats in phases.items() if name != "step")
    return f"<table><tr><th>phase</th><th>median ms</th><th>mean ms</th><th>% of step</th></tr>{rows}</table>"


def _step_chart(steps: Sequence[RolledStep], width: int = 900, height: int = 220) -> str:
    if not steps:
        return "<p>No steps recorded.</p>"
    stride = max(1, len(steps) // MAX_CHART_POINTS)
    shown: List[RolledStep] = list(steps[::stride])
    top = max(s.step_ms for s in shown) or 1.0
    first, last = shown[0].step, max(shown[-1].step, shown[0].step + 1)
    points = " ".join(f"{(s.step - first) / (last - first) * (width - 50) + 45:.1f},"
                      f"{height - 20 - s.step_ms / top * (height - 30):.1f}" for s in shown)
    return (f"<svg id='step-chart' width='{width}' height='{height}' role='img'>"
            f"<text x='0' y='12' font-size='11'>{top:.1f} ms</text>"
            f"<text x='0' y='{height - 20}' font-size='11'>0</text>"
            f"<text x='45' y='{height - 4}' font-size='11'>step {first}</text>"
            f"<text x='{width - 80}' y='{height - 4}' font-size='11'>step {last}</text>"
            f"<polyline fill='none' stroke='#4c78a8' stroke-width='1.2' points='{points}'/></svg>")
