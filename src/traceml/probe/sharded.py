"""Under sharded training (FSDP2's fully_shard, FSDP1): each phase's wait in the collectives.

FSDP all-gathers a unit's parameters before its forward (and again before its backward, where
they were freed), and reduce-scatters its gradients after its backward. These go through
torch.distributed's Python functions (all_gather_into_tensor, reduce_scatter_tensor and their
kin), so TraceML wraps those, and only once a sharded model is traced. On the CPU (gloo) a
collective called without async_op blocks the calling thread until every rank has joined and
the data has moved: the host time inside it is this rank's exposed wait, for the others and for
the wire alike, and counts in the step's comm_wait_ms, by the phase it happened in.

What this cannot see: a collective issued with async_op=True (its wait is elsewhere, in
Work.wait(), a C++ method), and collectives on CUDA, where the call returns once the work is
queued on FSDP's streams and the wait happens on the device. A CUDA model is therefore not
timed here (its comm_wait_ms stays None) rather than timed wrong.

The same wrappers give the memory ledger the most parameter bytes held all-gathered at once, on
the steps the ledger watches (one per reading, so other steps pay an int comparison): as each
all-gather returns, its output buffer plus the parameters FSDP2 still holds unsharded then (a
module's parameter is a plain tensor while unsharded, its DTensor shard otherwise), by phase.
It is read on CUDA too: sizes are host-side metadata. FSDP1's flat parameters are not read.

DeepSpeed's ZeRO does its collectives inside its engine's backward() (the gradients' reduction,
partly after autograd returns) and step() (the updated partitions' all-gather, after the
wrapped torch optimizer's own step): those two methods are timed on the engine's class as the
phases backward and optimizer, so that their collectives fall inside a phase. ZeRO keeps the
all-gather and reduce-scatter functions it looked up when its communication started, before
TraceML saw the engine: its backend is pointed at the wrapped ones.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Hashable, List, Optional, Set

from traceml.probe.ledger import tensor_storage
from traceml.probe.step_state import BACKWARD, FORWARD, NO_PHASE, OPTIMIZER, _now_ns
from traceml.probe.step import StepProbe

if TYPE_CHECKING:
    from types import ModuleType

    from torch.nn import Module

    from traceml.probe.ledger import LedgerWatch

log = logging.getLogger("traceml")
# Sets an attribute to a wrapper, remembering how to undo it: (owner, name, wrapper).
Replace = Callable[[object, str, object], None]

# The collectives FSDP1 and FSDP2 call (torch 2.0 to 2.13 spell some of them differently), and
# the ones a sharded loop's own code calls inside a step (a clipped norm's all_reduce).
COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather",
               "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
               "all_reduce", "broadcast", "all_to_all_single")
_GATHER_PHASES = {FORWARD: "forward", BACKWARD: "backward"}
ALL_GATHERS = frozenset(name for name in COLLECTIVES if "all_gather" in name)


class GatherWatch:
    """The most parameter bytes a sharded model held all-gathered at once, in forward and in
    backward, on the steps watched (the ledger sets `step` at each reading; see the module's
    docstring)."""

    def __init__(self, model: Module) -> None:
        self._model = weakref.ref(model)
        # The parameters FSDP manages, by name: a DTensor shard now, a plain tensor while unsharded.
        self._sharded_names: Set[str] = {name for name, parameter in model.named_parameters()
                                         if getattr(parameter, "_local_tensor", None) is not None}
        self.step = -1
        self.peak_bytes: Dict[str, Optional[int]] = {"forward": None, "backward": None}

    def gathered(self, phase: int, output: object) -> None:
        """An all-gather into `output` (a tensor, or a list of them) has returned in `phase`."""
        phase_name = _GATHER_PHASES.get(phase)
        if phase_name is None:
            return
        model = self._model()
        if model is None:
            return
        outputs = output if isinstance(output, (list, tuple)) else [output]
        held = sum(tensor.numel() * tensor.element_size() for tensor in outputs if hasattr(tensor, "numel"))
        seen: Set[Hashable] = set()
        for name, parameter in model.named_parameters():
            if name in self._sharded_names and getattr(parameter, "_local_tensor", None) is None:
                key, size = tensor_storage(parameter)
                if key not in seen:
                    seen.add(key)
                    held += size
        peak = self.peak_bytes[phase_name]
        if peak is None or held > peak:
            self.peak_bytes[phase_name] = held


def sharded_modules(model: object) -> List[object]:
    """The model's FSDP units (FSDP2's FSDPModule, FSDP1's FullyShardedDataParallel), outermost
    first; empty when it is not sharded (or torch has no FSDP)."""
    kinds: List[type] = []
    for module_name, name in (("torch.distributed.fsdp", "FullyShardedDataParallel"),
                              ("torch.distributed.fsdp", "FSDPModule"),  # torch >= 2.6
                              ("torch.distributed._composable.fsdp", "FSDPModule")):  # torch 2.4 and 2.5
        if all(kind.__name__ != name for kind in kinds):
            with contextlib.suppress(ImportError, AttributeError):
                kinds.append(getattr(importlib.import_module(module_name), name))
    modules = getattr(model, "modules", None)
    if not kinds or modules is None:
        return []
    return [module for module in modules() if isinstance(module, tuple(kinds))]


def sharded_by(model: Any) -> str:
    """"FSDP2", "FSDP1", "DeepSpeed ZeRO-2" (its stage), or "" when the model is not sharded."""
    if _deepspeed_engine_class(model) is not None:
        try:
            stage = int(model.zero_optimization_stage())
        except Exception:  # another DeepSpeed's engine: its stage unread
            return "DeepSpeed"
        return f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed"
    for module in sharded_modules(model):
        return "FSDP1" if type(module).__name__ == "FullyShardedDataParallel" else "FSDP2"
    return ""


def _deepspeed_engine_class(model: object) -> Optional[type]:
    """DeepSpeed's DeepSpeedEngine class when the model is one (found by name: importing
    deepspeed costs seconds, and a model that is none needs no answer from it)."""
    for cls in type(model).__mro__:
        if cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed."):
            return cls
    return None


def _engine_phase(probe: StepProbe, original: Callable[..., Any], phase: int) -> Callable[..., Any]:
    """DeepSpeedEngine.backward or .step, timed as `phase` (see the module's docstring). The
    torch backward and optimizer step inside open no phase of their own. When steps are
    inferred, the step that ends is the engine's: from its own step() at an accumulation
    boundary, once its collectives are done, not from the inner optimizer's."""

    @functools.wraps(original)
    def engine_method(engine: Any, *args: object, **kwargs: object) -> Any:
        if not probe.in_step and not probe.auto_steps:
            return original(engine, *args, **kwargs)
        boundary = False
        if phase == OPTIMIZER:
            try:
                boundary = bool(engine.is_gradient_accumulation_boundary())
            except Exception:  # another DeepSpeed: its inner optimizer's update ends the step
                boundary = False
        start_ns = probe.phase_begin(phase)
        try:
            return original(engine, *args, **kwargs)
        finally:
            if start_ns:
                probe.phase_end(phase, start_ns)
                if boundary and probe.auto_steps and probe.in_step and probe.open_phase == NO_PHASE:
                    probe.__exit__(None, None, None)

    engine_method.traceml_original = original  # type: ignore[attr-defined]
    return engine_method


def _wrap_deepspeed_lookups(dist: ModuleType, replace: Replace) -> None:
    """DeepSpeed's communication backend keeps the all-gather and reduce-scatter functions it
    found in torch.distributed when it started: point it at their wrapped twins."""
    import sys

    backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    for attribute in ("all_gather_function", "reduce_scatter_function"):
        kept = getattr(backend, attribute, None)
        for name in COLLECTIVES:
            wrapped = getattr(dist, name, None)
            if kept is not None and getattr(wrapped, "traceml_original", None) is kept:
                replace(backend, attribute, wrapped)
                break


def on_host(model: Module) -> bool:
    """Its parameters live on the CPU: its collectives block the host while they run."""
    for parameter in model.parameters():
        return parameter.device.type == "cpu"
    return False


class _Wrapping:
    """What the wrappers read: whether to time (the model is on the host), and the gathers'
    watch (None until a ledger asks for it)."""

    def __init__(self) -> None:
        self.timed = False
        self.watch: Optional[GatherWatch] = None


_wrapping = _Wrapping()


def time_collectives(probe: StepProbe, model: Module, replace: Replace,
                     compiling: Callable[[], bool], ledger: Optional[LedgerWatch] = None) -> bool:
    """A sharded model (FSDP, or a DeepSpeed engine): wrap torch.distributed's collectives (once, by `replace`, which
    remembers how to undo it) so that, on the CPU, their time inside a step's phases counts as
    the phase's collective wait, and the ledger (if any) gets the all-gathered peak.
    compiling: patches.dynamo.compiling()'s function, for code dynamo traces. True when the
    model's collectives are timed."""
    engine = _deepspeed_engine_class(model)
    if not sharded_modules(model) and engine is None:
        return False
    import torch.distributed as dist

    if not hasattr(dist.all_reduce, "traceml_original"):  # not wrapped yet (or undone since)
        _wrapping.timed, _wrapping.watch = False, None
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if callable(original):
                replace(dist, name, _wrapped(probe, original, compiling, name in ALL_GATHERS))
    if engine is not None and not hasattr(engine.step, "traceml_original"):  # type: ignore[attr-defined]  # DeepSpeedEngine's own methods
        replace(engine, "backward", _engine_phase(probe, engine.backward, BACKWARD))  # type: ignore[attr-defined]  # DeepSpeedEngine's own methods
        replace(engine, "step", _engine_phase(probe, engine.step, OPTIMIZER))  # type: ignore[attr-defined]  # DeepSpeedEngine's own methods
        _wrap_deepspeed_lookups(dist, replace)
    if ledger is not None and _wrapping.watch is None:
        _wrapping.watch = GatherWatch(model)
        ledger.watch_sharding(_wrapping.watch, sharded_by(model))
    if on_host(model):
        _wrapping.timed = True
        probe.comm_timed = True  # type: ignore[misc]  # probe.step: typed when the StepProbe split lands
    return _wrapping.timed


def _async_position(function: Callable[..., Any]) -> int:
    """Where async_op sits among the positional arguments (-1: nowhere)."""
    try:
        return list(inspect.signature(function).parameters).index("async_op")
    except (TypeError, ValueError):
        return -1


def _wrapped(probe: StepProbe, original: Callable[..., Any], compiling: Callable[[], bool],
             gathers: bool) -> Callable[..., Any]:
    async_at = _async_position(original)
    inside = [False]  # a collective made of others (all_gather of a list) counts once
    wrapping = _wrapping

    @functools.wraps(original)
    def collective(*args: object, **kwargs: object) -> Any:
        if compiling():  # dynamo traces the original: it knows collectives by their functions
            return original(*args, **kwargs)
        phase = probe.open_phase
        if phase == NO_PHASE or inside[0]:
            return original(*args, **kwargs)
        watch = wrapping.watch
        watching = gathers and watch is not None and watch.step == probe.step_index
        timing = wrapping.timed and not (kwargs.get("async_op") or (0 <= async_at < len(args) and args[async_at]))
        if not (timing or watching):
            return original(*args, **kwargs)
        inside[0] = True
        start_ns = _now_ns()
        try:
            result = original(*args, **kwargs)
        finally:
            inside[0] = False
            if timing:
                probe.comm_waited(phase, _now_ns() - start_ns)
        if watching:
            try:
                watch.gathered(phase, args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list")))  # type: ignore[union-attr]  # set while the wrapped collectives run
            except Exception:  # a parameter it cannot read: no gathered peak, the step goes on
                log.debug("traceml: the all-gathered peak stops", exc_info=True)
                wrapping.watch = None
        return result

    collective.traceml_original = original  # type: ignore[attr-defined]
    return collective
