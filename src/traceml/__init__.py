"""TraceML: always-on observability for PyTorch training. The public API, imported lazily.

`import traceml` imports nothing heavy: torch, the probe and the collector load on first use.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["trace_step", "__version__"]


def trace_step(model: Any = None) -> Any:
    """Trace one optimizer step: `with traceml.trace_step(model): ...`.

    Splits the step into input wait, host-to-device copies, forward (the outermost call of
    `model`), backward, optimizer and the rest, with memory; see DESIGN for the definitions.
    """
    from traceml.probe.step import trace_step as _trace_step

    return _trace_step(model)
