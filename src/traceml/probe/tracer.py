"""The object API: `Trace(port=...)` traces a loop without trace_step, names user spans and logs
scalars; under plain `python train.py` its collector serves the web dashboard.

    tracer = traceml.Trace(port=8080)
    with tracer.trace("training_loop"):
        for batch in loader:
            with tracer.span("forward_pass"):
                loss = model(batch).sum()
            loss.backward()
            optimizer.step()                      # each optimizer step ends a step
            tracer.log_scalar("train_loss", loss)  # a tensor is read later, off the hot path
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Literal, Optional

from traceml import rendezvous
from traceml.probe.step_state import fast_path
from traceml.records import ScalarRecord

if TYPE_CHECKING:
    from torch import Tensor

    from traceml.probe.step import StepProbe

log = logging.getLogger("traceml")
_now_ns = time.perf_counter_ns
PENDING_SCALARS = 4096  # device scalars waiting for their copy; beyond this they are dropped


class _PythonTraceState:
    """The Trace API's calls made every step, span and log_scalar, where the compiled timers
    are not built; else _fastpath.TraceState does the same in C (a float's scalar, a span's
    clock readings) and hands every other scalar to log_scalar here."""

    __slots__ = ("_probe",)
    _probe: Optional[StepProbe]

    # -- user spans and scalars --------------------------------------------------------------
    def span(self, name: str) -> "_Span":
        """`with tracer.span("forward_pass"):` a named part of the step, shown in the timeline
        and beside the breakdown (spans overlap the phases; they are not added to them)."""
        return _Span(self, name)

    def log_scalar(self, name: str, value: Any) -> None:
        """Log a float or a 0-dim tensor at the current step. A CUDA tensor is copied to the
        host without waiting and read by the sender thread once its copy is done: no sync."""
        probe = self._probe
        if probe is None:
            return
        try:
            step = probe.step_index if probe.in_step else max(0, probe.step_index - 1)
            if isinstance(value, (int, float)):
                probe.sender.push(ScalarRecord(probe.rank, step, name, float(value)))
            elif getattr(value, "is_cuda", False):
                probe.sender.defer(_DeviceScalar(probe.rank, step, name, value), limit=PENDING_SCALARS)
            else:  # a CPU tensor (or anything float() takes): reading it costs nothing to wait for
                probe.sender.push(ScalarRecord(probe.rank, step, name, float(value.detach().reshape(-1)[0])
                                               if hasattr(value, "detach") else float(value)))
        except Exception as exc:  # a bad value costs that scalar, never the training
            log.debug("traceml: scalar %s not logged: %s", name, exc)


class Trace(fast_path.TraceState if fast_path is not None else _PythonTraceState):  # type: ignore[misc]
    """A traced training run: steps inferred from `optimizer.step()`, user spans and scalars.

    port: where rank 0's collector serves the web dashboard when the script runs under plain
    `python` (None: no dashboard, the card at the end only). Under `traceml run` the launcher
    owns the collector and the dashboard (`--mode dashboard --port P`), and port is ignored.
    profile_memory: record device memory (allocated, peak, reserved) and host RSS each step.
    """

    def __init__(self, port: Optional[int] = None, profile_memory: bool = True):
        self.port, self.profile_memory = port, profile_memory
        self._probe: Optional[StepProbe] = None

    # -- the traced region -----------------------------------------------------------------
    def trace(self, name: str = "training") -> "_TracedRegion":
        """`with tracer.trace(name):` around the loop; name also names the run directory. Not
        a generator's context manager: one entered and dropped (a benchmark's) keeps tracing."""
        return _TracedRegion(self, name)

    def _start(self, name: str) -> None:
        from traceml.probe import process

        launched = bool(os.environ.get(rendezvous.ENV_COLLECTOR))  # under `traceml run`
        self._probe = process.infer_steps(web_port=None if launched else self.port, run_name=name,
                                          profile_memory=self.profile_memory)

    def _stop(self) -> None:
        from traceml.probe import process

        try:
            process.detach()  # closes the last step, sends the spans, takes the patches out
        except Exception:
            log.warning("traceml: could not close the traced region", exc_info=True)


class _TracedRegion:
    __slots__ = ("tracer", "name")

    def __init__(self, tracer: Trace, name: str):
        self.tracer, self.name = tracer, name

    def __enter__(self) -> Trace:
        self.tracer._start(self.name)
        return self.tracer

    def __exit__(self, *exc: object) -> Literal[False]:
        self.tracer._stop()
        return False


class _Span:
    """One call of a user span; its time is added to its step's total for that name."""

    __slots__ = ("tracer", "name", "start_ns")

    def __init__(self, tracer: _PythonTraceState, name: str):
        self.tracer, self.name, self.start_ns = tracer, name, 0

    def __enter__(self) -> "_Span":
        self.start_ns = _now_ns()
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        probe = self.tracer._probe
        if probe is not None:
            try:
                probe.span_done(self.name, self.start_ns, _now_ns())
            except Exception:
                log.debug("traceml: span %s not recorded", self.name, exc_info=True)
        return False


class _DeviceScalar:
    """A scalar on its way from the device: a non-blocking copy to pinned host memory and an
    event behind it; the sender reads the value once the event says the copy is done."""

    __slots__ = ("rank", "step", "name", "host_copy", "copied")

    def __init__(self, rank: int, step: int, name: str, tensor: Tensor):
        import torch

        self.rank, self.step, self.name = rank, step, name
        self.host_copy = tensor.detach().reshape(-1)[:1].to("cpu", non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def ready(self) -> bool:
        return bool(self.copied.query())

    def record(self) -> ScalarRecord:
        return ScalarRecord(self.rank, self.step, self.name, float(self.host_copy[0]))


if fast_path is not None:
    fast_path.configure_trace(ScalarRecord, _PythonTraceState.log_scalar)
