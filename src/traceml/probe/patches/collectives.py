"""DDP's and FSDP's collectives: under DDP, backward's wait for the others' all-reduce; under
FSDP (probe/sharded.py), each phase's wait in its all-gathers and reduce-scatters."""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from traceml.probe.patches.dynamo import compiling
from traceml.probe.patches.patch import Patch
from traceml.probe.step import StepProbe

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger("traceml")


class Collectives(Patch):
    """Patches nothing until a model is hooked (model_hooked); FSDP's wrappers go at remove()."""

    def __init__(self, probe: StepProbe):
        super().__init__(probe)
        self._ddp_models: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()  # the traced DDP models

    def model_hooked(self, model: Module) -> None:
        self._time_ddp(model)
        self._time_sharded(model)

    def _time_ddp(self, model: Module) -> None:
        """Under DDP, backward splits into this rank's own compute and its wait for the others'
        all-reduce (the straggler is the rank that waits least): see when_gradients_done.

        No comm hook: any Python comm hook (torch's own allreduce_hook too) costs each bucket tens
        of µs (benchmarks/overhead.py), and DDP keeps its C++ all-reduce only without one.
        """
        try:
            from torch.nn.parallel import DistributedDataParallel
        except ImportError:  # a torch built without distributed support
            return
        if isinstance(model, DistributedDataParallel):
            self._ddp_models.add(model)
            self.probe.comm_timed = True

    def _time_sharded(self, model: Module) -> None:
        """Under FSDP: each phase's wait in the all-gathers and reduce-scatters (on the CPU), and
        the memory ledger's all-gathered peak."""
        try:
            from traceml.probe.sharded import time_collectives

            time_collectives(self.probe, model, self.replace, compiling(),
                             getattr(self.probe.sender, "ledger", None))
        except Exception:  # torch's internals moved: no collective wait, the steps as they were
            log.warning("traceml: FSDP's collectives are not timed", exc_info=True)

    def when_gradients_done(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[RemovableHandle]:
        """Have probe.note_gradients_done run once this backward has computed every gradient: a
        final callback queued with the autograd engine from a hook on the graph's root, which
        runs first. Final callbacks run in the order queued once the graph is done, and DDP
        queues its own (which waits for the all-reduce) when its last bucket is ready, so after
        this one. Returns the hook's handle, removed after backward (the graph may be kept and
        run again); None when no DDP model reduces in this backward (no_sync, gradient
        accumulation)."""
        import torch

        if not any(model.require_backward_grad_sync for model in self._ddp_models):
            return None
        tensors = args[0] if args else kwargs.get("tensors")
        root = tensors if isinstance(tensors, torch.Tensor) else next(iter(tensors or ()), None)
        node = getattr(root, "grad_fn", None)
        if node is None:
            return None
        queue_callback = torch.autograd.Variable._execution_engine.queue_callback
        note_gradients_done = self.probe.note_gradients_done

        def at_backward_start(grad_outputs: Tuple[object, ...]) -> None:
            queue_callback(note_gradients_done)

        return node.register_prehook(at_backward_start)
