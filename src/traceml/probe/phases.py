"""The patches and hooks that report phases to the probe: DataLoader, H2D copies, model forward,
backward, optimizer step, and the garbage collector. Each is installed once per process."""
from __future__ import annotations

import gc
import logging
import sys
from typing import Any, Callable, List

from traceml.probe.step import BACKWARD, FORWARD, H2D, OPTIMIZER, StepProbe, _now_ns

log = logging.getLogger("traceml")
_undo: List[Callable[[], None]] = []  # how to take back each installed patch, newest last


def install_patches(probe: StepProbe) -> None:
    if _undo:
        return
    _patch_dataloader(probe)
    _patch_h2d(probe)
    _patch_backward(probe)
    _hook_optimizers(probe)
    gc.callbacks.append(probe.gc_callback)
    _undo.append(lambda: gc.callbacks.remove(probe.gc_callback))
    _watch_exit_code(probe)


def remove_patches() -> None:
    """Restore everything install_patches changed, leaving torch as it was."""
    while _undo:
        _undo.pop()()


def _replace(owner: Any, name: str, replacement: Any) -> None:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    _undo.append(lambda: setattr(owner, name, original))


def _patch_dataloader(probe: StepProbe) -> None:
    from torch.utils.data import dataloader

    iterator_class = dataloader._BaseDataLoaderIter
    original_next = iterator_class.__next__

    def __next__(self: Any) -> Any:
        start_ns = _now_ns()
        try:
            return original_next(self)
        finally:  # inline, not a probe method: this runs once per batch
            if probe.in_step:
                probe.input_wait_inside_ns += _now_ns() - start_ns
            else:
                probe.input_wait_gap_ns += _now_ns() - start_ns

    __next__.__wrapped__ = original_next  # type: ignore[attr-defined]
    _replace(iterator_class, "__next__", __next__)


def _patch_h2d(probe: StepProbe) -> None:
    """Time copies of CPU tensors to another device made directly inside a step.

    Only moves made outside the model's own phases count: a `.to()` inside forward is forward.
    Whether a call moves anything is known only once it returns, so the clock starts on every
    CPU tensor's `.to()` inside a step and is dropped when the result stayed on the CPU.
    """
    import torch

    def wrap(original: Any) -> Any:
        def moved(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not probe.in_step or probe.open_phase != -1 or not self.is_cpu:
                return original(self, *args, **kwargs)
            if not probe.phase_begin(H2D):
                return original(self, *args, **kwargs)
            try:
                result = original(self, *args, **kwargs)
            except BaseException:
                probe.note_failure(H2D)
                probe.phase_end(H2D)
                raise
            if result is self or result.is_cpu:
                probe.cancel_phase(H2D)
            else:
                probe.phase_end(H2D)
            return result

        moved.__wrapped__ = original  # type: ignore[attr-defined]
        moved.__name__ = original.__name__
        moved.__doc__ = original.__doc__
        return moved

    _replace(torch.Tensor, "to", wrap(torch.Tensor.to))
    _replace(torch.Tensor, "cuda", wrap(torch.Tensor.cuda))


def _patch_backward(probe: StepProbe) -> None:
    """`loss.backward()` goes through torch.autograd.backward, looked up at call time."""
    import torch.autograd

    original_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        probe.phase_begin(BACKWARD)
        try:
            return original_backward(*args, **kwargs)
        except BaseException:
            probe.note_failure(BACKWARD)
            raise
        finally:
            probe.phase_end(BACKWARD)

    backward.__wrapped__ = original_backward  # type: ignore[attr-defined]
    backward.__doc__ = original_backward.__doc__
    _replace(torch.autograd, "backward", backward)


def _hook_optimizers(probe: StepProbe) -> None:
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        probe.phase_begin(OPTIMIZER)  # returns None: a pre-hook's result would replace the args

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        probe.phase_end(OPTIMIZER)

    _undo.append(register_optimizer_step_pre_hook(before_step).remove)
    _undo.append(register_optimizer_step_post_hook(after_step).remove)


class TimedForward:
    """Stands in for `model.forward` (as an instance attribute) to time the outermost call.

    Not a forward hook: any hook sends every call of the module through torch's slow path,
    which costs more than all the rest of the probe. Pickling or deep-copying the model
    yields its own forward back, never this wrapper; `inspect.signature` sees the original.
    """

    __slots__ = ("probe", "__wrapped__", "tensor_type")

    def __init__(self, probe: StepProbe, forward: Any, tensor_type: type):
        self.probe = probe
        self.__wrapped__ = forward
        self.tensor_type = tensor_type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe = self.probe
        if probe.phase_begin(FORWARD):
            probe.forward_calls += 1
            probe.samples += _batch_size(args, kwargs, self.tensor_type)
        try:
            layers = probe.layers
            if layers is not None and layers.active:  # a deep-dive step: count saved tensors
                with layers.saved_tensors_context():
                    return self.__wrapped__(*args, **kwargs)
            return self.__wrapped__(*args, **kwargs)
        except BaseException:
            probe.note_failure(FORWARD)
            raise
        finally:
            probe.phase_end(FORWARD)

    def __getattr__(self, name: str) -> Any:  # __name__, __doc__, __func__, ... of the original
        return getattr(self.__wrapped__, name)

    def __reduce__(self) -> Any:
        return (_same, (self.__wrapped__,))


def _same(value: Any) -> Any:
    return value


class _ForwardHandle:
    """Takes a model's TimedForward back out, restoring what forward was before."""

    def __init__(self, model: Any, timed: TimedForward, had_own_forward: bool):
        self._model, self._timed, self._had_own_forward = model, timed, had_own_forward

    def remove(self) -> None:
        if self._model.__dict__.get("forward") is not self._timed:
            return  # someone wrapped it again since: leave their wrapper alone
        if self._had_own_forward:
            self._model.forward = self._timed.__wrapped__
        else:
            del self._model.forward


def hook_model(probe: StepProbe, model: Any) -> List[Any]:
    """Time the outermost call of this model as forward and count the samples it is given."""
    import torch

    had_own_forward = "forward" in model.__dict__  # e.g. Accelerate's autocast wrapper
    timed = TimedForward(probe, model.forward, torch.Tensor)
    model.forward = timed
    _time_ddp_collectives(probe, model)
    return [_ForwardHandle(model, timed, had_own_forward)]


def _time_ddp_collectives(probe: StepProbe, model: Any) -> None:
    """Under DDP, note when each gradient bucket is ready, so backward splits into this rank's
    own compute and its wait for the others (the straggler is the rank that waits least).

    DDP's default all-reduce, run through a comm hook that first notes the time. DDP accepts
    one comm hook per model and only before its first backward: if the user registered one,
    or it is too late, collective wait is simply not measured.
    """
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed support
        return
    if not isinstance(model, DistributedDataParallel):
        return
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # No annotations: DDP checks the names `state` and `bucket`, and any annotation's type.
    def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        probe.note_bucket_ready()
        return allreduce_hook(state, bucket)

    try:
        model.register_comm_hook(model.process_group, timed_allreduce)
    except Exception as exc:
        log.info("traceml: DDP collective wait not measured (%s)", exc)
        return
    probe.comm_timed = True


def _batch_size(args: tuple, kwargs: dict, tensor_type: type) -> int:
    """The leading dimension of the first tensor the model is given, looking one level deep."""
    if args and isinstance(args[0], tensor_type):  # model(inputs): the common case, first
        shape = args[0].shape
        return shape[0] if shape else 1
    for value in (*args, *kwargs.values()):
        if isinstance(value, dict):
            candidates: Any = value.values()
        elif isinstance(value, (list, tuple)):
            candidates = value
        else:
            candidates = (value,)
        for candidate in candidates:
            if isinstance(candidate, tensor_type):
                return int(candidate.shape[0]) if candidate.dim() > 0 else 1
    return 0


def _watch_exit_code(probe: StepProbe) -> None:
    """Under plain `python train.py` nobody else knows the exit code: note it on the way out."""
    original_excepthook = sys.excepthook
    original_exit = sys.exit

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        probe.exit_code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        original_excepthook(exc_type, exc, tb)

    def exit(status: Any = None) -> None:
        probe.exit_code = status if isinstance(status, int) else (0 if status is None else 1)
        original_exit(status)

    _replace(sys, "excepthook", excepthook)
    _replace(sys, "exit", exit)
