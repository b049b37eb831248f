"""The deep-dive's per-layer figures as the summary, the rules, the terminal and the web page
read them: per step, from the sums the probe sent over its sampled steps."""
from __future__ import annotations

from typing import List, Optional

from traceml.analysis.layer_rows import AliveLayer, DeepDiveFigures, LayerRow
from traceml.records import LayerReport

LOW_COVERAGE = 0.6  # leaf modules holding less of the model's time than this: the card says why


def deep_dive_figures(report: Optional[LayerReport]) -> DeepDiveFigures:
    """The deep-dive as the summary and the web page give it: its per-layer rows ("layers"), and
    ("deep_dive") how they were sampled and how much of the model's time its leaf modules hold,
    with the words for a low coverage. No rows and None without a deep-dive."""
    if report is None:
        return {"layers": [], "deep_dive": None}
    note = None
    if min(report.forward_coverage, report.backward_coverage) < LOW_COVERAGE:
        note = (f"leaf modules hold {report.forward_coverage:.0%} of forward and "
                f"{report.backward_coverage:.0%} of backward: the rest runs in the model's own code "
                "between them (functional calls such as F.scaled_dot_product_attention, residual "
                "adds, reshapes) and counts in the parent modules' rows")
    return {"layers": layer_rows(report),
            "deep_dive": {"sampled_steps": report.sampled_steps, "every_n_steps": report.every_n_steps,
                          "forward_coverage": report.forward_coverage,
                          "backward_coverage": report.backward_coverage, "coverage_note": note}}


def layer_rows(report: LayerReport) -> List[LayerRow]:
    """Deep-dive figures per step (the sums over sampled steps, divided by their count), slowest first."""
    per_step = 1.0 / report.sampled_steps
    rows: List[LayerRow] = [{"name": layer.name, "type": layer.kind, "leaf": layer.leaf,
             "calls_per_step": layer.calls * per_step, "forward_ms": layer.forward_ms * per_step,
             "backward_ms": layer.backward_ms * per_step,
             "memory_bytes": round(layer.saved_bytes * per_step),
             "output_bytes": round(layer.output_bytes * per_step),
             "allocated_delta_bytes": (round(layer.allocated_delta_bytes * per_step)
                                       if layer.allocated_delta_bytes is not None else None),
             "alive_bytes": layer.alive_bytes} for layer in report.layers]
    return sorted(rows, key=lambda row: -(row["forward_ms"] + row["backward_ms"]))


def layers_alive(layers: List[LayerRow]) -> List[AliveLayer]:
    """The leaf layers whose outputs or saved tensors outlive their step, the most memory first."""
    rows = [row for row in layers if row["leaf"] and row["alive_bytes"]]
    return [{"name": row["name"], "alive_bytes": row["alive_bytes"]}
            for row in sorted(rows, key=lambda row: -row["alive_bytes"])]
