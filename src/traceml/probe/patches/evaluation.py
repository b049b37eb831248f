"""Where evaluation between steps is seen: torch's grad-mode managers and Module.eval report to
probe/evaluation.py's regions, and Hugging Face Trainer's evaluate and predict are timed whole."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

from traceml.probe.evaluation import EvaluationRegions
from traceml.probe.patches.imports import WhenImported
from traceml.probe.patches.patch import Patch
from traceml.probe.step import StepProbe


class EvaluationPatch(Patch):
    def __init__(self, probe: StepProbe, when_imported: WhenImported, traced_models: Callable[[], List[Any]]):
        super().__init__()
        self.probe = probe
        self.when_imported = when_imported
        self.traced_models = traced_models
        self.regions: Optional[EvaluationRegions] = None  # what the model's calls between steps report to

    def install(self) -> None:
        """Time no-grad regions between steps in which the model runs as evaluation: torch's
        grad-mode context managers' enter and exit, on their classes."""
        import torch
        from torch.autograd import grad_mode

        regions = EvaluationRegions(self.probe, self.traced_models)
        for manager in (grad_mode.no_grad, grad_mode.inference_mode, grad_mode.set_grad_enabled):
            self.replace(manager, "__enter__", regions.entering(manager.__enter__))
            self.replace(manager, "__exit__", regions.leaving(manager.__exit__))
        self.replace(torch.nn.Module, "eval", regions.eval_called(torch.nn.Module.eval))
        self.regions = regions
        self.when_imported("torch._dynamo.callback", self._stop_watching_at_compilations)
        self.on_remove(self._stop)
        self.when_imported("transformers.trainer", self._not_training_in_trainer_evaluation)

    def _stop(self) -> None:
        if self.regions is not None:
            self.regions.stop()
        self.regions = None

    def evaluating(self) -> bool:
        """Whether the training thread is in an evaluation region between steps now."""
        regions = self.regions
        return regions is not None and regions.evaluating()

    def _stop_watching_at_compilations(self, callbacks: Any) -> None:
        """What torch compiles is traced with no hook of the regions' in place (see evaluation.py)."""
        handler, started = callbacks.callback_handler, self.regions.compilation_started  # type: ignore[union-attr]
        handler.register_start_callback(started)

        def remove() -> None:
            try:
                handler.remove_start_callback(started)
            except ValueError:  # torch._dynamo.reset() took it out already
                pass

        self.on_remove(remove)

    def _not_training_in_trainer_evaluation(self, module: Any) -> None:
        """Hugging Face Trainer's evaluation fetches its batches with gradients on: its DataLoader
        waits are evaluation, not the training's input, with or without the integration."""
        for name, wrapped in evaluation_wrapped(module.Trainer).items():
            self.replace(module.Trainer, name, wrapped)


def evaluation_wrapped(trainer_class: Any) -> Dict[str, Callable[..., Any]]:
    """Trainer's evaluation entry points (evaluate, predict) that are not wrapped yet, wrapped
    (init() sets them for good; zero-code mode for as long as the run is traced)."""
    return {name: not_training(getattr(trainer_class, name)) for name in ("evaluate", "predict")
            if not getattr(getattr(trainer_class, name), "_traceml_not_training", False)}


def not_training(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an evaluation entry point: all of it is evaluation (the model's calls, the loader's
    waits, Trainer's own work around them), none of it the training's input wait."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from traceml.probe import step

        probe = step._probe
        if probe is None or not probe.evaluation_begin():
            return method(*args, **kwargs)
        try:
            return method(*args, **kwargs)
        finally:
            probe.evaluation_end()

    wrapper._traceml_not_training = True  # type: ignore[attr-defined]
    return wrapper
