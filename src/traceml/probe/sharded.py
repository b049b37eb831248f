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
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, List

from traceml.probe.step import NO_PHASE, StepProbe, _now_ns

log = logging.getLogger("traceml")

# The collectives FSDP1 and FSDP2 call (torch 2.0 to 2.13 spell some of them differently), and
# the ones a sharded loop's own code calls inside a step (a clipped norm's all_reduce).
COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather",
               "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter",
               "all_reduce", "broadcast", "all_to_all_single")


def sharded_modules(model: Any) -> List[Any]:
    """The model's FSDP units (FSDP2's FSDPModule, FSDP1's FullyShardedDataParallel), outermost
    first; empty when it is not sharded (or torch has no FSDP)."""
    kinds = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        kinds.append(FullyShardedDataParallel)
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
        kinds.append(FSDPModule)
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch 2.4 and 2.5
            kinds.append(FSDPModule)
        except ImportError:
            pass
    modules = getattr(model, "modules", None)
    if not kinds or modules is None:
        return []
    kinds_tuple = tuple(kinds)
    return [module for module in modules() if isinstance(module, kinds_tuple)]


def on_host(model: Any) -> bool:
    """Its parameters live on the CPU: its collectives block the host while they run."""
    for parameter in model.parameters():
        return parameter.device.type == "cpu"
    return False


def time_collectives(probe: StepProbe, model: Any, replace: Callable[[Any, str, Any], None],
                      compiling: Any) -> bool:
    """A sharded model on the CPU: wrap torch.distributed's collectives (once, by `replace`,
    which remembers how to undo it) so that their time inside a step's phases counts as the
    phase's collective wait. compiling: the phases' `_is_compiling_flag` holder, for code
    dynamo traces. True when the model's collectives are timed."""
    if not sharded_modules(model) or not on_host(model):
        return False
    import torch.distributed as dist

    if not hasattr(dist.all_reduce, "traceml_original"):  # not wrapped yet (or undone since)
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if callable(original):
                replace(dist, name, _timed(probe, original, compiling))
    probe.comm_timed = True
    return True


def _async_position(function: Callable[..., Any]) -> int:
    """Where async_op sits among the positional arguments (-1: nowhere)."""
    try:
        return list(inspect.signature(function).parameters).index("async_op")
    except (TypeError, ValueError):
        return -1


def _timed(probe: StepProbe, original: Callable[..., Any], compiling: Any) -> Callable[..., Any]:
    async_at = _async_position(original)
    inside = [False]  # a collective made of others (all_gather of a list) counts once

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if compiling._is_compiling_flag:  # dynamo traces the original: it knows collectives by their functions
            return original(*args, **kwargs)
        phase = probe.open_phase
        if (phase == NO_PHASE or inside[0] or kwargs.get("async_op")
                or (0 <= async_at < len(args) and args[async_at])):
            return original(*args, **kwargs)
        inside[0] = True
        start_ns = _now_ns()
        try:
            return original(*args, **kwargs)
        finally:
            inside[0] = False
            probe.comm_waited(phase, _now_ns() - start_ns)

    collective.traceml_original = original  # type: ignore[attr-defined]
    return collective
