"""Checkpoint saves on the training thread: the user's planned work, named as such, not a stall."""
import functools
from threading import get_ident
from typing import Callable, ParamSpec, Tuple, TypeVar

from traceml.probe.patches.imports import WhenImported
from traceml.probe.patches.patch import Patch
from traceml.probe.step_state import CHECKPOINT_BETWEEN_NS, CHECKPOINT_NS, _now_ns
from traceml.probe.step import StepProbe

P = ParamSpec("P")  # a save function's parameters ...
R = TypeVar("R")  # ... and what it returns, passed through
# Where each save lives: torch.save; torch.distributed.checkpoint's save (and async_save's
# blocking part); safetensors' save_file and save_model; save_pretrained; Accelerate's
# save_state and save_model; Hugging Face Trainer's and Lightning's save methods.
_SAVES_ON_IMPORT = (
    ("torch.distributed.checkpoint", lambda dcp: dcp, ("save", "async_save", "save_state_dict")),
    ("safetensors.torch", lambda module: module, ("save_file", "save_model")),
    ("transformers.modeling_utils", lambda module: module.PreTrainedModel, ("save_pretrained",)),
    ("accelerate.accelerator", lambda module: module.Accelerator, ("save_state", "save_model")),
    ("transformers.trainer", lambda module: module.Trainer, ("_save_checkpoint",)),
    ("lightning.pytorch.trainer.trainer", lambda module: module.Trainer, ("save_checkpoint",)),
    ("pytorch_lightning.trainer.trainer", lambda module: module.Trainer, ("save_checkpoint",)),
)


class CheckpointSaves(Patch):
    """Saves call each other (save_state gathers the state, then calls safetensors and
    torch.save): the outermost call is timed, so the work around the writes counts too."""

    def __init__(self, probe: StepProbe, when_imported: WhenImported):
        super().__init__(probe)
        self.when_imported = when_imported
        self._saving = False

    def install(self) -> None:
        import torch

        self._patch_methods(torch, ("save",))
        for module_name, owner_in, names in _SAVES_ON_IMPORT:
            self.when_imported(module_name, lambda module, owner_in=owner_in, names=names:  # type: ignore[misc]  # the lambda binds its loop values
                               self._patch_methods(owner_in(module), names))

    def _patch_methods(self, owner: object, names: Tuple[str, ...]) -> None:
        for name in names:
            if hasattr(owner, name):
                self.replace(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, original: Callable[P, R]) -> Callable[P, R]:
        probe = self.probe

        @functools.wraps(original)
        def save(*args: P.args, **kwargs: P.kwargs) -> R:
            # Another thread's save (an asynchronous checkpoint's writer) does not stall training.
            if self._saving or get_ident() != probe.training_thread:
                return original(*args, **kwargs)
            self._saving = True
            start_ns = _now_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self._saving = False
                elapsed_ns = _now_ns() - start_ns
                probe.window[CHECKPOINT_NS] += elapsed_ns
                if not probe.in_step:
                    probe.window[CHECKPOINT_BETWEEN_NS] += elapsed_ns
                    probe.count_planned(2)

        return save
