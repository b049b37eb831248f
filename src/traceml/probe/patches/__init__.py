"""The patches that report a step's phases to the probe, owned by one Patches registry.

The data flows from the training's own calls into the probe's sums and window, each through the
module for its concern: the input wait (input_wait.py), host-to-device copies (h2d.py), the
model's forward (model_calls.py, with what it is given: tokens.py), backward (backward.py),
the optimizer's update (optimizers.py), DDP's and FSDP's collectives (collectives.py),
evaluation between steps (evaluation.py) and checkpoint saves (saves.py); exit.py sees the
run end. imports.py patches modules at their first import; first_call.py
awaits the model's first call; dynamo.py keeps all of them out of torch.compile's graphs.
"""
import gc
from types import ModuleType
from typing import Any, List

from traceml.probe.patches.backward import Backward
from traceml.probe.patches.collectives import Collectives
from traceml.probe.patches.evaluation import EvaluationRegions
from traceml.probe.patches.exit import ExitCode, SigtermFlush
from traceml.probe.patches.first_call import FirstModelCall
from traceml.probe.patches.h2d import HostToDevice
from traceml.probe.patches.imports import ImportHooks
from traceml.probe.patches.input_wait import InputWait
from traceml.probe.patches.model_calls import ModelCalls
from traceml.probe.patches.optimizers import OptimizerSteps
from traceml.probe.patches.patch import Patch
from traceml.probe.patches.saves import CheckpointSaves
from traceml.probe.step import StepProbe


class Patches(Patch):
    """One attachment's patches: install() puts them in place in order, remove() takes them all
    back newest first (and stops awaiting a first call), leaving torch as it was. Its own: the
    garbage collector's callback and torch.compile's compile events (probe/compile.py)."""

    def __init__(self, probe: StepProbe, first_call: FirstModelCall):
        super().__init__(probe)
        self.first_call = first_call
        self.imports = ImportHooks()
        collectives = Collectives(probe)
        self.evaluation = EvaluationRegions(probe, self.imports.when_imported, lambda: self.models.traced_models())
        self.models = ModelCalls(probe, self.evaluation, collectives)
        self._patches: List[Patch] = [
            self.imports, InputWait(probe, getattr(probe.sender, "loaders", None)), HostToDevice(probe),
            Backward(probe, collectives), OptimizerSteps(probe), CheckpointSaves(probe, self.imports.when_imported),
            self.evaluation, ExitCode(probe), SigtermFlush(probe), collectives]

    def install(self) -> None:
        for patch in self._patches:
            patch.install()
        self.imports.when_imported("torch._dynamo.callback", self._watch_compilations)
        gc.callbacks.append(self.probe.gc_callback)
        self.on_remove(lambda: gc.callbacks.remove(self.probe.gc_callback))

    def remove(self) -> None:
        self.first_call.disarm()
        super().remove()
        for patch in reversed(self._patches):
            patch.remove()

    def hook_model(self, model: Any) -> List[Any]:
        """Time this model's outermost call as forward; returns handles whose remove() stops it."""
        return self.models.hook(model)

    def _watch_compilations(self, callbacks: ModuleType) -> None:
        from traceml.probe import compile as compile_watch

        remove = compile_watch.install(self.probe, callbacks)
        if remove is not None:
            self.on_remove(remove)
