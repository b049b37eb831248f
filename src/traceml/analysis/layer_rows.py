"""The shapes of the deep-dive's per-layer figures (report.deep_dive computes them): what the
summary's layers and deep_dive hold, and what the memory rules read of them."""
from __future__ import annotations

from typing import List, Optional, TypedDict


class LayerRow(TypedDict):
    """One module's deep-dive figures a step (the summary's layers)."""

    name: str
    type: str
    leaf: bool
    calls_per_step: float
    forward_ms: float
    backward_ms: float
    memory_bytes: int  # saved for backward
    output_bytes: int
    allocated_delta_bytes: Optional[int]
    alive_bytes: int  # of its outputs and saved tensors, still alive after the step


class DeepDive(TypedDict):
    """How the deep-dive sampled, and how much of the model's time its leaf modules hold."""

    sampled_steps: int
    every_n_steps: int
    forward_coverage: float
    backward_coverage: float
    coverage_note: Optional[str]


class DeepDiveFigures(TypedDict):
    layers: List[LayerRow]
    deep_dive: Optional[DeepDive]


class AliveLayer(TypedDict):
    name: str
    alive_bytes: int
