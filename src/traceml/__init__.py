"""TraceML: always-on observability for PyTorch training. The public API, imported lazily.

`import traceml` imports nothing heavy: torch, the probe and the collector load on first use.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, TypeVar, Union

from traceml import probe as _probe_package

if TYPE_CHECKING:
    from torch.nn import Module

    from traceml.records import StepRecord

__version__ = "0.1.0"
__all__ = ["trace_step", "trace_model_instance", "Trace", "summary", "__version__"]

_trace_step: Optional[Callable[[Any], Any]] = None
M = TypeVar("M", bound="Module")  # a model handed in, and handed back


def trace_step(model: Any = None) -> Any:
    """Trace one optimizer step: `with traceml.trace_step(model): ...`.

    Splits the step into input wait, host-to-device copies, forward (the outermost call of
    `model`), backward, optimizer and the rest, with memory; docs/phases-and-verdicts.md says what each one counts.
    """
    global _trace_step
    if _trace_step is None:
        first_call_ns = time.perf_counter_ns()
        from traceml.probe import process

        # TraceML's own start-up belongs to the first step, so step 0 matches the loop's clock.
        process.first_call_ns = first_call_ns
        _trace_step = process.trace_step
        # Later `traceml.trace_step(...)` calls go straight to the probe's: one frame less a step.
        globals()["trace_step"] = _trace_step
    return _trace_step(model)


def trace_model_instance(model: M, every_n_steps: Optional[int] = None) -> M:
    """Deep-dive on `model`: per-module forward and backward time, saved-activation and output
    memory, measured on every Nth step that trace_step traces (default 10). Returns the model."""
    from traceml.probe.process import trace_model_instance as _trace_model_instance

    return _trace_model_instance(model, every_n_steps)


def summary() -> dict:
    """This process's figures so far, flat, for a tracker: `wandb.log(traceml.summary())`.

    Keys like "traceml/phase/input_wait/share", "traceml/step/median_ms",
    "traceml/diagnosis/primary"; the same rules as the card, over this rank's steps. Empty
    before the first traced step.
    """
    from traceml.probe import step

    probe = step._probe
    if probe is None:
        return {}
    return _summarize_steps(probe.sender.local_steps())


def _summarize_steps(steps: List[StepRecord]) -> Dict[str, Union[int, float, str, None]]:
    from traceml.report.summary import flat_summary

    return flat_summary(steps)


# A rank that loses its collector keeps its own summary, summed up as traceml.summary() is.
_probe_package.summarize_steps = _summarize_steps


def __getattr__(name: str) -> Any:
    """`traceml.Trace` (the object API) and the integration modules, loaded on first use."""
    if name == "Trace":
        from traceml.probe.tracer import Trace

        return Trace
    if name in ("integrations", "hf_decorators"):
        import importlib

        return importlib.import_module(f"traceml.{name}")
    raise AttributeError(f"module 'traceml' has no attribute {name!r}")
