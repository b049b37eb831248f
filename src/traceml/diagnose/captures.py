"""Automatic captures: which layers grew between the deep-dive sample taken before a rule fired
and the steps sampled right after it, told beside the finding that rule belongs to.

A layer grew when its time a step (forward plus backward) or the memory it saves for backward
is well above the sample before, by a margin that noise does not reach. A capture in which no
layer grew says so: the time or memory went somewhere outside the model's layers.
"""
from __future__ import annotations

from typing import List, Sequence, TypedDict

from traceml.records import (CAPTURE_MEMORY, CAPTURE_REGRESSION, CAPTURE_SPIKE, Finding, FindingKind,
                             LayerCapture, LayerStat)

GROWTH_SHARE = 0.3  # a layer grew: this share above its figure before...
MIN_GROWTH_MS = 0.2  # ... and by at least this much time a step...
TOTAL_SHARE = 0.1  # ... and this share of all the leaf layers' time a step
MIN_GROWTH_BYTES = 2 ** 20  # ... or this much saved memory a step
TOP_LAYERS = 3  # layers named in a finding's evidence
BROAD_SHARE = 0.5  # no layer holding this share of what grew: the whole model ran slower
# The findings a capture's reason belongs to, the first present taking it. Steps slowing down
# against the run's start are the model's time growing; with none of these findings, a capture
# stays in the summary's captures and beside no finding.
FINDINGS_OF = {
    CAPTURE_REGRESSION: (FindingKind.COMPUTE_BOUND, FindingKind.COMPUTE_STRAGGLER, FindingKind.STEP_SPIKES,
                         FindingKind.RECOMPILATION),
    CAPTURE_SPIKE: (FindingKind.STEP_SPIKES, FindingKind.UNTRACED_WORK, FindingKind.INPUT_BOUND,
                    FindingKind.GC_PRESSURE),
    CAPTURE_MEMORY: (FindingKind.MEMORY_CREEP, FindingKind.MEMORY_PRESSURE),
}


class GrownLayer(TypedDict):
    """A leaf layer that grew between a capture's two samples: its figures a step, before and after."""

    name: str
    type: str
    time_before_ms: float
    time_after_ms: float
    saved_before_bytes: int
    saved_after_bytes: int


def grown_layers(capture: LayerCapture) -> List[GrownLayer]:
    """The leaf layers that grew, the most grown first: per-step figures before and after."""
    before = {layer.name: layer for layer in capture.before if layer.leaf}
    # Two samples of a few steps each differ by noise spread over every layer; a layer worth
    # naming grew by a share of the whole model's time too.
    noise_ms = TOTAL_SHARE * _leaf_time_ms(capture.before, capture.before_steps)
    rows: List[GrownLayer] = []
    for layer in capture.after:
        if not layer.leaf:
            continue
        old = before.get(layer.name)
        time_before = (old.forward_ms + old.backward_ms) / capture.before_steps if old and capture.before_steps else 0.0
        saved_before = old.saved_bytes / capture.before_steps if old and capture.before_steps else 0.0
        time_after = (layer.forward_ms + layer.backward_ms) / capture.after_steps
        saved_after = layer.saved_bytes / capture.after_steps
        time_grew = time_after - time_before >= max(GROWTH_SHARE * time_before, MIN_GROWTH_MS, noise_ms)
        memory_grew = saved_after - saved_before >= max(GROWTH_SHARE * saved_before, MIN_GROWTH_BYTES)
        if time_grew or memory_grew:
            rows.append({"name": layer.name, "type": layer.kind,
                         "time_before_ms": round(time_before, 3), "time_after_ms": round(time_after, 3),
                         "saved_before_bytes": int(saved_before), "saved_after_bytes": int(saved_after)})
    by_memory = capture.reason == CAPTURE_MEMORY
    rows.sort(key=lambda row: -(row["saved_after_bytes"] - row["saved_before_bytes"] if by_memory
                                else row["time_after_ms"] - row["time_before_ms"]))
    return rows


def capture_text(capture: LayerCapture, rows: Sequence[GrownLayer]) -> str:
    """One line: when, why, and what grew."""
    said = f"after step {capture.step} ({capture.detail})"
    if not rows:
        return (f"{said}: no layer grew against the deep-dive sample before; what went wrong did "
                "not stay in the model's layers")
    before_ms, after_ms = _leaf_time_ms(capture.before, capture.before_steps), _leaf_time_ms(capture.after, capture.after_steps)
    growth_ms = [row["time_after_ms"] - row["time_before_ms"] for row in rows]
    if capture.reason != CAPTURE_MEMORY and len(rows) > 1 and max(growth_ms) <= BROAD_SHARE * sum(growth_ms):
        leaves = sum(1 for layer in capture.after if layer.leaf)
        return (f"{said}: {len(rows)} of {leaves} layers slower at once ({before_ms:.1f} → "
                f"{after_ms:.1f} ms a step in all): no one layer, the whole model ran slower (a busy "
                "machine, a slower clock, or larger inputs)")
    parts = []
    for row in rows[:TOP_LAYERS]:
        if row["time_after_ms"] - row["time_before_ms"] >= MIN_GROWTH_MS:
            parts.append(f"{row['name']} ({row['type']}) {row['time_before_ms']:.2f} → "
                         f"{row['time_after_ms']:.2f} ms a step")
        else:
            parts.append(f"{row['name']} ({row['type']}) saves {row['saved_before_bytes'] / 2 ** 20:.1f} → "
                         f"{row['saved_after_bytes'] / 2 ** 20:.1f} MiB a step")
    return f"{said}: " + "; ".join(parts)


def attach_captures(findings: List[Finding], captures: Sequence[LayerCapture]) -> None:
    """Name each capture's grown layers in the evidence of the finding its rule belongs to
    (`captured_layers`, with `captured_step` and `captured_grown`, how many layers grew); a
    finding keeps the first capture that names layers, else the first."""
    for capture in captures:
        kinds = FINDINGS_OF.get(capture.reason, ())
        owner = next((f for f in findings if f.kind in kinds), None)
        if owner is None:
            continue
        rows = grown_layers(capture)
        held = owner.evidence.get("captured_layers")
        if held is not None and (owner.evidence.get("captured_grown") or not rows):
            continue
        owner.evidence = {**owner.evidence, "captured_layers": capture_text(capture, rows),
                          "captured_step": capture.step, "captured_grown": len(rows)}


def _leaf_time_ms(layers: Sequence[LayerStat], steps: int) -> float:
    return sum(layer.forward_ms + layer.backward_ms for layer in layers if layer.leaf) / steps if steps else 0.0
