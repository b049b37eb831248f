"""PyTorch Lightning: one step per optimizer step (accumulated batches included), validation
left out of the training's input wait. For both the `lightning` and `pytorch_lightning`
namespaces.

    from traceml.integrations import lightning as traceml_lightning
    trainer = Trainer(..., callbacks=[traceml_lightning.TraceMLCallback()])

Lightning runs forward and backward inside optimizer.step(closure); the probe times the update
from when the closure returns, so forward, backward and optimizer each get their own time.
"""
from __future__ import annotations

import logging
from typing import Any, Tuple

from traceml.probe import process, step

log = logging.getLogger("traceml")
STEPS_FROM = "Lightning (optimizer steps)"


def _callback_bases() -> Tuple[type, ...]:
    """Lightning checks callbacks against its own Callback class: be both, where both exist."""
    bases = []
    try:
        from lightning.pytorch import Callback as LightningCallback

        bases.append(LightningCallback)
    except ImportError:
        pass
    try:
        from pytorch_lightning import Callback as PytorchLightningCallback

        bases.append(PytorchLightningCallback)  # type: ignore[arg-type]  # either package's Callback
    except ImportError:
        pass
    if not bases:
        raise ImportError("traceml.integrations.lightning needs lightning or pytorch_lightning")
    return tuple(bases)


def init() -> None:
    """Nothing to fit in Lightning's classes: the callback does it all. Kept for symmetry with
    the Hugging Face integration, so `traceml_lightning.init()` is always safe to call."""


class TraceMLCallback(*_callback_bases()):  # type: ignore[misc]
    """Traces fit(): steps inferred from the optimizer, validation apart from training."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        process.infer_steps(steps_from=STEPS_FROM, device_of=pl_module)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        try:
            process.detach()  # the last step's window ends where it ended
        except Exception:
            log.debug("traceml: could not close the last step", exc_info=True)

    # Validation (and the sanity check before training) is evaluation, timed whole; its loader
    # waits are not the training's input.
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        _evaluating(True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        _evaluating(False)

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        _evaluating(True)

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        _evaluating(False)


def _evaluating(starts: bool) -> None:
    probe = step._probe
    if probe is None:
        return
    if starts:
        probe.evaluation_begin()
    else:
        probe.evaluation_end()


__all__ = ["init", "TraceMLCallback"]
