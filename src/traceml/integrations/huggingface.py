"""Hugging Face Trainer: one step per optimizer update group, its micro-batches summed and the
batches fetched for it included; evaluation, logging and checkpoints between updates are
`outside`.

    from traceml.integrations import huggingface as traceml_hf
    traceml_hf.init()
    trainer = Trainer(..., callbacks=[traceml_hf.TraceMLTrainerCallback()])
    # or: trainer = traceml_hf.TraceMLTrainer(...)

Trainer fetches all the micro-batches of an update (get_batch_samples) before its step
callback: init() makes that fetch open the step, so its wait counts for the update that
consumes it. The update ends at optimizer.step(), as inferred steps do; what Trainer does
after it (scheduler, logging, evaluation, saving) is the time between steps.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, List, Optional

from transformers import Trainer, TrainerCallback

from traceml.probe import process, step
from traceml.probe.patches.evaluation import evaluation_wrapped

log = logging.getLogger("traceml")
STEPS_FROM = "Hugging Face Trainer (optimizer updates)"
_installed = False


def init() -> None:
    """Fit Trainer (the class, once per process) for tracing; calling it again does nothing."""
    global _installed
    if _installed:
        return
    original_fetch = Trainer.get_batch_samples

    @functools.wraps(original_fetch)
    def get_batch_samples(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = step._probe
        if probe is not None and probe.auto_steps and not probe.in_step:
            probe.enter()  # the update group starts with fetching its batches
        return original_fetch(self, *args, **kwargs)

    Trainer.get_batch_samples = get_batch_samples  # type: ignore[method-assign]
    for name, wrapped in evaluation_wrapped(Trainer).items():
        setattr(Trainer, name, wrapped)
    _installed = True


class TraceMLTrainerCallback(TrainerCallback):
    """Starts tracing when training starts (on the model Trainer trains) and closes the last
    step when it ends."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        init()
        process.infer_steps(steps_from=STEPS_FROM, model=model, device_of=model)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            process.detach()  # the last update's window ends where it ended
        except Exception:
            log.debug("traceml: could not close the last step", exc_info=True)


class TraceMLTrainer(Trainer):
    """A Trainer with TraceMLTrainerCallback already in its callbacks."""

    def __init__(self, *args: Any, callbacks: Optional[List[Any]] = None, **kwargs: Any):
        callbacks = list(callbacks or [])
        if not any(isinstance(c, TraceMLTrainerCallback) or c is TraceMLTrainerCallback
                   for c in callbacks):
            callbacks.append(TraceMLTrainerCallback())
        init()
        super().__init__(*args, callbacks=callbacks, **kwargs)  # type: ignore[misc]  # callbacks taken out of kwargs above


__all__ = ["init", "TraceMLTrainerCallback", "TraceMLTrainer"]
