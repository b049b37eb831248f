"""Backward: `loss.backward()` goes through torch.autograd.backward, looked up at call time."""
from typing import Any, Protocol

from traceml.probe.patches.patch import Patch
from traceml.probe.step_state import BACKWARD, fast_path
from traceml.probe.step import StepProbe


class GradientsDone(Protocol):
    """Under DDP, what tells the probe this rank's gradients are computed (collectives.py)."""

    def when_gradients_done(self, args: tuple, kwargs: dict) -> Any: ...


class Backward(Patch):
    def __init__(self, probe: StepProbe, gradients: GradientsDone):
        super().__init__(probe)
        self.gradients = gradients

    def install(self) -> None:
        import torch.autograd

        probe, when_gradients_done = self.probe, self.gradients.when_gradients_done
        original_backward = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            if not probe.in_step and not probe.auto_steps:  # outside the steps: nothing to time
                return original_backward(*args, **kwargs)
            start_ns = probe.phase_begin(BACKWARD)
            armed = when_gradients_done(args, kwargs) if start_ns and probe.comm_timed else None
            try:
                result = original_backward(*args, **kwargs)
            except BaseException:
                probe.note_failure(BACKWARD)
                if start_ns:
                    probe.phase_end(BACKWARD, start_ns)
                raise
            finally:
                if armed is not None:
                    armed.remove()
            if start_ns:
                probe.phase_end(BACKWARD, start_ns)
            if probe.auto_steps:
                probe.backward_returned()
            return result

        backward.__wrapped__ = original_backward  # type: ignore[attr-defined]
        backward.__doc__ = original_backward.__doc__
        # Compiled where built: a plain step's backward; any other goes to the Python above.
        self.replace(torch.autograd, "backward", backward if fast_path is None else fast_path.Timer(
            fast_path.BACKWARD_CALL, original_backward, backward, probe))
