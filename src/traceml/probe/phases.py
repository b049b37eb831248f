"""The patches and hooks that report phases to the probe: DataLoader, H2D copies, model forward,
backward, optimizer step, and the garbage collector. Each is installed once per process."""
from __future__ import annotations

import gc
import logging
import sys
from typing import Any, Callable, List, Optional

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
    import torch
    from torch.utils.data import dataloader

    grad_enabled = torch.is_grad_enabled
    iterator_class = dataloader._BaseDataLoaderIter
    original_next = iterator_class.__next__

    def __next__(self: Any) -> Any:
        start_ns = _now_ns()
        try:
            return original_next(self)
        finally:  # inline, not a probe method: this runs once per batch
            if probe.in_step:
                probe.input_wait_inside_ns += _now_ns() - start_ns
            elif probe.counting_input and grad_enabled():
                probe.input_wait_gap_ns += _now_ns() - start_ns
            # Between steps with gradients off (an evaluation loop), or while an integration
            # says evaluation runs: the wait is not the training's input, it stays `outside`.

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
            if not probe.in_step and probe.auto_steps and self.is_cpu:
                return first_copy(self, *args, **kwargs)
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

        def first_copy(self: Any, *args: Any, **kwargs: Any) -> Any:
            """Steps inferred: the batch's copy to the device is what starts the step (once it
            is known to have moved something; a `.to(dtype)` on the CPU starts nothing)."""
            start_ns = _now_ns()
            result = original(self, *args, **kwargs)
            if result is not self and not result.is_cpu and not probe.in_step:
                probe.enter(start_ns)
                probe.phase_ns[H2D] += _now_ns() - start_ns
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

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
        # args are step()'s own, the optimizer first: step(closure) has it second.
        closure = (args[1] if len(args) > 1 else kwargs.get("closure")) if kwargs or len(args) > 1 else None
        if closure is None:
            probe.phase_begin(OPTIMIZER)
            return None  # None keeps the arguments as they are
        # optimizer.step(closure) runs forward and backward inside the step (Lightning does
        # this every step): the update is timed from when the closure returns.
        def timed_closure() -> Any:
            result = closure()
            probe.phase_begin(OPTIMIZER)
            return result

        if len(args) > 1:
            return (args[0], timed_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": timed_closure}

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        probe.phase_end(OPTIMIZER)
        if probe.auto_steps:
            probe.optimizer_stepped(optimizer)

    _undo.append(register_optimizer_step_pre_hook(before_step).remove)
    _undo.append(register_optimizer_step_post_hook(after_step).remove)


class TimedForward:
    """Stands in for `model.forward` (as an instance attribute) to time the outermost call.

    Not a forward hook: any hook sends every call of the module through torch's slow path,
    which costs more than all the rest of the probe. Pickling or deep-copying the model
    yields its own forward back, never this wrapper; `inspect.signature` sees the original.
    """

    __slots__ = ("probe", "__wrapped__", "tensor_type", "token_inputs")

    def __init__(self, probe: StepProbe, forward: Any, tensor_type: type):
        self.probe = probe
        self.__wrapped__ = forward
        self.tensor_type = tensor_type
        # Whether this model is given token ids, decided at its first call: the check then
        # costs one attribute read a call, not a look at the inputs.
        self.token_inputs: Optional[bool] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe = self.probe
        if probe.phase_begin(FORWARD):
            probe.forward_calls += 1
            probe.samples += _batch_size(args, kwargs, self.tensor_type)
            if self.token_inputs is None:
                self.token_inputs = _token_ids(args, kwargs, self.tensor_type) is not None
            if self.token_inputs:
                _count_tokens(probe, args, kwargs, self.tensor_type)
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


class OutermostModules:
    """Forward timing while the model is not known (steps inferred, no trace_step(model)).

    During the first step only, process-wide module hooks time each outermost module call as
    forward. When the optimizer first steps, the outermost module called that holds its
    parameters is the model: it gets its TimedForward, and these hooks (which would send every
    module call through torch's slow path) are taken out.
    """

    def __init__(self, probe: StepProbe):
        self.probe = probe
        self.depth = 0
        self.called: dict = {}  # id -> module, the outermost calls in first-call order
        self._handles: List[Any] = []

    def install(self) -> "OutermostModules":
        import torch
        from torch.nn.modules import module as nn_module

        self._tensor_type = torch.Tensor
        try:  # always_call: the depth must come back down when a forward raises
            after = nn_module.register_module_forward_hook(self._after, always_call=True)
        except TypeError:  # torch before 2.1
            after = nn_module.register_module_forward_hook(self._after)
        self._handles = [nn_module.register_module_forward_pre_hook(self._before), after]
        _undo.extend(handle.remove for handle in self._handles)
        self.probe.outermost = self
        return self

    def _before(self, module: Any, args: Any) -> None:
        # A module without parameters called on its own (a loss, an activation) is not the model.
        if self.depth == 0 and next(module.parameters(), None) is not None:
            self.called.setdefault(id(module), module)
            if self.probe.phase_begin(FORWARD):
                self.probe.forward_calls += 1
                self.probe.samples += _batch_size(args, {}, self._tensor_type)
        self.depth += 1

    def _after(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.probe.phase_end(FORWARD)

    def settle(self, optimizer: Any) -> None:
        """The optimizer stepped: time the outermost module holding its parameters from now on."""
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        model = next((module for module in self.called.values()
                      if any(id(p) in owned for p in module.parameters())), None)
        self.remove()
        if model is not None:
            from traceml.probe.step import hook_inferred_model

            hook_inferred_model(model)
        else:
            log.info("traceml: no module called before the optimizer step holds its parameters; "
                     "forward is not timed")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.called.clear()
        if self.probe.outermost is self:
            self.probe.outermost = None


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


def _token_ids(args: tuple, kwargs: dict, tensor_type: type) -> Any:
    """The token ids a model is given: input_ids, or an integer (batch, length) first input."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], tensor_type):
        ids = args[0]
    if not isinstance(ids, tensor_type) or ids.is_floating_point() or ids.dim() != 2:
        return None
    return ids


def _count_tokens(probe: StepProbe, args: tuple, kwargs: dict, tensor_type: type) -> None:
    """Token inputs: input_ids (or an integer first input) of shape (batch, length), and the
    real tokens per attention_mask. A mask on the device is summed there and copied to pinned
    host memory without waiting; the step's record reads it once the step is done."""
    ids = _token_ids(args, kwargs, tensor_type)
    if ids is None:
        return
    probe.tokens += ids.numel()
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, tensor_type):
        return
    if mask.is_cpu:
        probe.real_tokens = (probe.real_tokens or 0) + int(mask.sum())
    else:
        probe.token_copies.append(mask.sum().to("cpu", non_blocking=True))
        if probe.real_tokens is None:
            probe.real_tokens = 0


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
    _flush_on_sigterm(probe)


def _flush_on_sigterm(probe: StepProbe) -> None:
    """A launcher stopping the ranks (torchrun after one failed, a job's time limit) sends
    SIGTERM, whose default ends Python at once, without atexit: the last records would go
    with it. Where the script left SIGTERM at its default, send what is buffered first, then
    die of the same signal, so the exit status is what it would have been."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the script handles SIGTERM itself: its handler, its exit, our atexit

    def on_sigterm(signum: int, frame: Any) -> None:
        # A second SIGTERM (sent to the group, and forwarded by `traceml run`) must not cut the
        # flush short: ignored until it is done.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            probe.exit_code = 128 + signum
            probe.finish()
            probe.sender.close(exit_code=probe.exit_code, timeout_s=2.0)
        except Exception:
            pass
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    _undo.append(restore)
