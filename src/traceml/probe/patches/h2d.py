"""Host-to-device copies made directly inside a step (a CPU tensor's `.to()` and `.cuda()`), the
h2d phase; with steps inferred, the batch's copy starts the step."""
from typing import Any

from traceml.probe.patches.patch import Patch
from traceml.probe.step_state import H2D, _now_ns, fast_path


class HostToDevice(Patch):
    """Only moves made outside the model's own phases count: a `.to()` inside forward is forward.
    Whether a call moves anything is known only once it returns, so the clock starts on every
    CPU tensor's `.to()` inside a step and is dropped when the result stayed on the CPU."""

    def install(self) -> None:
        import torch

        original_to = torch.Tensor.to
        # Compiled where built: it sends the calls `moved` would pass straight on (outside the
        # steps, inside a phase) to the original without a Python frame.
        self.replace(torch.Tensor, "to", self._timed(original_to) if fast_path is None else fast_path.Timer(
            fast_path.TENSOR_TO, original_to, self._timed(original_to), self.probe))
        self.replace(torch.Tensor, "cuda", self._timed(torch.Tensor.cuda))

    def _timed(self, original: Any) -> Any:
        import torch

        probe, grad_enabled = self.probe, torch.is_grad_enabled

        def moved(self: Any, *args: object, **kwargs: object) -> Any:
            if not probe.in_step and probe.auto_steps and self.is_cpu:
                return first_copy(self, *args, **kwargs)
            if not probe.in_step or probe.open_phase != -1 or not self.is_cpu:
                return original(self, *args, **kwargs)
            start_ns = probe.phase_begin(H2D)
            if not start_ns:
                return original(self, *args, **kwargs)
            try:
                result = original(self, *args, **kwargs)
            except BaseException:
                probe.note_failure(H2D)
                probe.phase_end(H2D, start_ns)
                raise
            if result is self or result.is_cpu:
                probe.cancel_phase(H2D)
            else:
                probe.phase_end(H2D, start_ns)
            return result

        def first_copy(self: Any, *args: object, **kwargs: object) -> Any:
            """Steps inferred: the batch's copy to the device is what starts the step (once it
            is known to have moved something; a `.to(dtype)` on the CPU starts nothing; nor
            does an evaluation's copy, made with gradients off)."""
            start_ns = _now_ns()
            result = original(self, *args, **kwargs)
            if result is not self and not result.is_cpu and not probe.in_step and grad_enabled():
                probe.enter(start_ns)
                probe.sums[H2D] += _now_ns() - start_ns
            return result

        moved.__wrapped__ = original  # type: ignore[attr-defined]
        moved.__name__ = original.__name__
        moved.__doc__ = original.__doc__
        return moved
