"""The patches and hooks that report phases to the probe: DataLoader, queue gets, H2D copies, model
forward, backward, optimizer step, and the garbage collector. Each is installed once per process."""
from __future__ import annotations

import functools
import gc
import logging
import os
import queue
import sys
import types
import weakref
from threading import get_ident
from typing import Any, Callable, Dict, List, Optional

from traceml.probe.step import (BACKWARD, CHECKPOINT_BETWEEN_NS, CHECKPOINT_NS, EVAL_NS, FORWARD, FORWARD_CALLS, H2D,
                                INPUT_WAIT_GAP_NS, INPUT_WAIT_NS, OPTIMIZER, REAL_TOKENS, SAMPLES,
                                TOKEN_COPIES, TOKENS, StepProbe, _now_ns, fast_path)

log = logging.getLogger("traceml")
_undo: List[Callable[[], None]] = []  # how to take back each installed patch, newest last


def install_patches(probe: StepProbe) -> None:
    if _undo:
        return
    _patch_dataloader(probe)
    _patch_h2d(probe)
    _patch_backward(probe)
    _hook_optimizers(probe)
    _patch_checkpoint_saves(probe)
    _time_evaluation_regions(probe)
    when_imported("transformers.trainer", _not_training_in_trainer_evaluation)
    when_imported("torch._dynamo.callback", lambda callbacks: _watch_compilations(probe, callbacks))
    gc.callbacks.append(probe.gc_callback)
    _undo.append(lambda: gc.callbacks.remove(probe.gc_callback))
    _watch_exit_code(probe)


def remove_patches() -> None:
    """Restore everything install_patches changed, leaving torch as it was."""
    disarm_first_call()
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
    watch = getattr(probe.sender, "loaders", None)
    made_on_thread = watch.made_on_thread if watch is not None else None

    def __next__(self: Any) -> Any:
        start_ns = _now_ns()
        if get_ident() != probe.training_thread:
            # A thread that fills a buffer for the training (a prefetcher): not the training's
            # wait, but what that thread spends making a batch, for INPUT_BOUND's advice.
            try:
                return original_next(self)
            finally:
                if made_on_thread is not None:
                    made_on_thread(self, _now_ns() - start_ns)
        probe.fetching += 1
        try:
            return original_next(self)
        finally:
            probe.fetching -= 1
            _count_input_wait(probe, _now_ns() - start_ns, grad_enabled)

    __next__.__wrapped__ = original_next  # type: ignore[attr-defined]
    # Compiled where built: the same work on the training thread, another thread's call in Python.
    timed_next = __next__ if fast_path is None else fast_path.Timer(
        fast_path.NEXT, original_next, __next__, probe, grad_enabled=grad_enabled)
    if watch is None:
        _replace(iterator_class, "__next__", timed_next)
    else:
        _watch_training_iterators(probe, iterator_class, timed_next, grad_enabled, watch)
    _patch_queue_gets(probe, grad_enabled)


def _count_input_wait(probe: StepProbe, elapsed_ns: int, grad_enabled: Callable[[], bool]) -> None:
    """The training thread's wait for a batch: the step's input wait; between steps, the
    training's (gradients on) or, with gradients off, an evaluation loop's: `outside`, and
    evaluation. (A trainer's evaluation is timed whole.)"""
    if probe.in_step:
        probe.sums[INPUT_WAIT_NS] += elapsed_ns
    elif not probe.in_evaluation:
        probe.window[INPUT_WAIT_GAP_NS if grad_enabled() else EVAL_NS] += elapsed_ns


def _patch_queue_gets(probe: StepProbe, grad_enabled: Callable[[], bool]) -> None:
    """The training thread's block on a queue.Queue that another thread fills (a prefetching
    thread's buffer: MONAI's ThreadDataLoader, a hand-written prefetcher) is its input wait,
    split as the DataLoader's. Other threads' gets are theirs, and one inside a timed DataLoader
    __next__ (the pin-memory thread's queue) is that wait already."""
    original_get = queue.Queue.get

    @functools.wraps(original_get)
    def get(self: Any, block: bool = True, timeout: Optional[float] = None) -> Any:
        if get_ident() != probe.training_thread or probe.fetching:
            return original_get(self, block, timeout)
        start_ns = _now_ns()
        try:
            return original_get(self, block, timeout)
        finally:
            _count_input_wait(probe, _now_ns() - start_ns, grad_enabled)

    _replace(queue.Queue, "get", get)


def _watch_training_iterators(probe: StepProbe, iterator_class: Any, timed_next: Any,
                              grad_enabled: Callable[[], bool], watch: Any) -> None:
    """Note each training iterator for the sender thread's watch (probe/loaders.py) once: when
    it is made, or, for one made before TraceML attached, at its first batch after. Nothing of
    this runs per batch."""

    def training() -> bool:
        return bool(probe.in_step) or (not probe.in_evaluation and grad_enabled())

    def first_next(self: Any) -> Any:
        """The first batch after TraceML attached: the iterator the loop was already in (a
        `for` loop makes it before the first step) is noted; then the timer alone runs."""
        if iterator_class.__dict__.get("__next__") is first_next:
            setattr(iterator_class, "__next__", timed_next)
        if training():
            _note_iterator(watch, self)
        return timed_next(self)

    first_next.__wrapped__ = getattr(timed_next, "__wrapped__", timed_next)  # type: ignore[attr-defined]
    _replace(iterator_class, "__next__", first_next)
    original_init = iterator_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if training():  # an evaluation's iterator is not the training's input
            _note_iterator(watch, self)

    __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
    _replace(iterator_class, "__init__", __init__)


def _note_iterator(watch: Any, iterator: Any) -> None:
    """Hand a training iterator to the sender thread's watch (probe.loaders), once."""
    try:
        watch.note(iterator)
    except Exception:  # a loader we cannot watch: INPUT_BOUND's advice without its figures
        log.debug("traceml: a DataLoader iterator is not watched", exc_info=True)


def _patch_h2d(probe: StepProbe) -> None:
    """Time copies of CPU tensors to another device made directly inside a step.

    Only moves made outside the model's own phases count: a `.to()` inside forward is forward.
    Whether a call moves anything is known only once it returns, so the clock starts on every
    CPU tensor's `.to()` inside a step and is dropped when the result stayed on the CPU.
    """
    import torch

    grad_enabled = torch.is_grad_enabled

    def wrap(original: Any) -> Any:
        def moved(self: Any, *args: Any, **kwargs: Any) -> Any:
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

        def first_copy(self: Any, *args: Any, **kwargs: Any) -> Any:
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

    original_to = torch.Tensor.to
    # Compiled where built: it sends the calls `moved` would pass straight on (outside the
    # steps, inside a phase) to the original without a Python frame.
    _replace(torch.Tensor, "to", wrap(original_to) if fast_path is None else fast_path.Timer(
        fast_path.TENSOR_TO, original_to, wrap(original_to), probe))
    _replace(torch.Tensor, "cuda", wrap(torch.Tensor.cuda))


def _patch_backward(probe: StepProbe) -> None:
    """`loss.backward()` goes through torch.autograd.backward, looked up at call time."""
    import torch.autograd

    original_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        if not probe.in_step and not probe.auto_steps:  # outside the steps: nothing to time
            return original_backward(*args, **kwargs)
        start_ns = probe.phase_begin(BACKWARD)
        armed = _when_gradients_done(probe, args, kwargs) if start_ns and probe.comm_timed else None
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
    _replace(torch.autograd, "backward", backward if fast_path is None else fast_path.Timer(
        fast_path.BACKWARD_CALL, original_backward, backward, probe))


class _AfterImport:
    """A sys.meta_path finder that runs patches right after a module's first import: modules a
    run may never use (torch.distributed.checkpoint, a trainer, torch._dynamo) are patched when
    the script imports them, and never imported by TraceML."""

    def __init__(self) -> None:
        self.waiting: Dict[str, List[Callable[[Any], None]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.waiting:
            return None  # every other import: one dict lookup
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module
        waiting = self.waiting

        def exec_module(module: Any) -> None:
            try:
                original_exec(module)
            finally:
                del loader.exec_module  # the loader as it was
            for patch in waiting.pop(name, ()):
                _apply_patch(patch, module)

        loader.exec_module = exec_module
        return spec


_after_import: Optional[_AfterImport] = None


def when_imported(module_name: str, patch: Callable[[Any], None]) -> None:
    """Run patch(module) now if the module is imported, else right after its first import."""
    global _after_import
    module = sys.modules.get(module_name)
    if module is not None:
        _apply_patch(patch, module)
        return
    if _after_import is None:
        finder = _after_import = _AfterImport()
        sys.meta_path.insert(0, finder)

        def remove() -> None:
            global _after_import
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            _after_import = None

        _undo.append(remove)
    _after_import.waiting.setdefault(module_name, []).append(patch)


def _apply_patch(patch: Callable[[Any], None], module: Any) -> None:
    try:
        patch(module)
    except Exception:  # a library version we do not know: less telemetry, never the user's run
        log.debug("traceml: could not patch %s", getattr(module, "__name__", module), exc_info=True)


def _patch_checkpoint_saves(probe: StepProbe) -> None:
    """Time checkpoint saves on the training thread: torch.save, safetensors' save_file and
    save_model, torch.distributed.checkpoint's save (and async_save's blocking part),
    save_pretrained, Accelerate's save_state and save_model, Hugging Face Trainer's and
    Lightning's save methods. A checkpoint is the user's planned work, named as such, not a
    stall. Saves call each other (save_state gathers the state, then calls safetensors and
    torch.save): the outermost call is timed, so the work around the writes counts too."""
    import torch

    saving = [False]

    def timed(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def save(*args: Any, **kwargs: Any) -> Any:
            # Another thread's save (an asynchronous checkpoint's writer) does not stall training.
            if saving[0] or get_ident() != probe.training_thread:
                return original(*args, **kwargs)
            saving[0] = True
            start_ns = _now_ns()
            try:
                return original(*args, **kwargs)
            finally:
                saving[0] = False
                elapsed_ns = _now_ns() - start_ns
                probe.window[CHECKPOINT_NS] += elapsed_ns
                if not probe.in_step:
                    probe.window[CHECKPOINT_BETWEEN_NS] += elapsed_ns
                    probe.count_planned(2)

        return save

    def patch_methods(owner: Any, *names: str) -> None:
        for name in names:
            if hasattr(owner, name):
                _replace(owner, name, timed(getattr(owner, name)))

    patch_methods(torch, "save")
    when_imported("torch.distributed.checkpoint",
                  lambda dcp: patch_methods(dcp, "save", "async_save", "save_state_dict"))
    when_imported("safetensors.torch", lambda module: patch_methods(module, "save_file", "save_model"))
    when_imported("transformers.modeling_utils",
                  lambda module: patch_methods(module.PreTrainedModel, "save_pretrained"))
    when_imported("accelerate.accelerator",
                  lambda module: patch_methods(module.Accelerator, "save_state", "save_model"))
    when_imported("transformers.trainer", lambda module: patch_methods(module.Trainer, "_save_checkpoint"))
    for lightning in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        when_imported(lightning, lambda module: patch_methods(module.Trainer, "save_checkpoint"))


_evaluation: Any = None  # the EvaluationRegions the model's calls between steps report to


def _time_evaluation_regions(probe: StepProbe) -> None:
    """Time no-grad regions between steps in which the model runs as evaluation (see
    probe/evaluation.py): torch's grad-mode context managers' enter and exit, on their classes."""
    global _evaluation
    import torch
    from torch.autograd import grad_mode

    from traceml.probe.evaluation import EvaluationRegions

    regions = EvaluationRegions(probe, lambda: [traced.model() for traced in list(_models.values())])
    for manager in (grad_mode.no_grad, grad_mode.inference_mode, grad_mode.set_grad_enabled):
        _replace(manager, "__enter__", regions.entering(manager.__enter__))
        _replace(manager, "__exit__", regions.leaving(manager.__exit__))
    _replace(torch.nn.Module, "eval", regions.eval_called(torch.nn.Module.eval))
    _evaluation = regions
    when_imported("torch._dynamo.callback", lambda callbacks: _stop_watching_at_compilations(regions, callbacks))

    def remove() -> None:
        global _evaluation
        regions.stop()
        _evaluation = None

    _undo.append(remove)


def _stop_watching_at_compilations(regions: Any, callbacks: Any) -> None:
    """What torch compiles is traced with no hook of the regions' in place (see evaluation.py)."""
    handler = callbacks.callback_handler
    handler.register_start_callback(regions.compilation_started)

    def remove() -> None:
        try:
            handler.remove_start_callback(regions.compilation_started)
        except ValueError:  # torch._dynamo.reset() took it out already
            pass

    _undo.append(remove)


def evaluating() -> bool:
    """Whether the training thread is in an evaluation region between steps now."""
    regions = _evaluation
    return regions is not None and regions.evaluating()


def _not_training_in_trainer_evaluation(module: Any) -> None:
    """Hugging Face Trainer's evaluation fetches its batches with gradients on: its DataLoader
    waits are evaluation, not the training's input, with or without the integration."""
    for name, wrapped in evaluation_wrapped(module.Trainer).items():
        _replace(module.Trainer, name, wrapped)


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


def _watch_compilations(probe: StepProbe, callbacks: Any) -> None:
    from traceml.probe import compile as compile_watch

    remove = compile_watch.install(probe, callbacks)
    if remove is not None:
        _undo.append(remove)


def _hook_optimizers(probe: StepProbe) -> None:
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
        if not probe.in_step and not probe.auto_steps:  # outside the steps: nothing to time
            return None
        if probe.layers_active:  # a sampled step (a plain one's update never comes here)
            probe.watch_optimizer(optimizer)
        # args are step()'s own, the optimizer first: step(closure) has it second.
        closure = (args[1] if len(args) > 1 else kwargs.get("closure")) if kwargs or len(args) > 1 else None
        if closure is None:
            start_ns = probe.phase_begin(OPTIMIZER)
            if start_ns:
                probe._optimizer_timed, probe._optimizer_start_ns = id(optimizer), start_ns
            return None  # None keeps the arguments as they are
        # optimizer.step(closure) runs forward and backward inside the step (Lightning does
        # this every step): the update is timed from when the closure returns. An optimizer
        # that calls the closure again (LBFGS re-evaluates the loss) stops the update's clock
        # meanwhile: those forwards and backwards are forward and backward.
        def timed_closure() -> Any:
            after_step(optimizer, (), {}, inferring=False)
            result = closure()
            before_step(optimizer, (optimizer,), {})
            return result

        if len(args) > 1:
            return (args[0], timed_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": timed_closure}

    def after_step(optimizer: Any, args: Any, kwargs: Any, inferring: bool = True) -> None:
        if probe._optimizer_timed == id(optimizer):
            probe._optimizer_timed = 0
            probe.phase_end(OPTIMIZER, probe._optimizer_start_ns)
        if inferring and probe.auto_steps:
            probe.optimizer_stepped(optimizer)

    pre_hook: Any = before_step
    post_hook: Any = after_step
    if fast_path is not None:  # a plain step's update compiled; any other, the Python above
        pre_hook = fast_path.Timer(fast_path.OPTIMIZER_BEFORE, before_step, before_step, probe)
        post_hook = fast_path.Timer(fast_path.OPTIMIZER_AFTER, after_step, after_step, probe)
    _undo.append(register_optimizer_step_pre_hook(pre_hook).remove)
    _undo.append(register_optimizer_step_post_hook(post_hook).remove)


# -- the model's forward: timed from its class, never from the model object --------------------
#
# Why the class: whatever is set on the model itself (an instance `forward`, a hook in its
# hook dicts) travels with it into pickles, torch.save, deepcopy and state, and a checkpoint
# made under TraceML would name traceml. A class is pickled by name, so a method set on it is
# invisible there; the instance is left exactly as the user built it. Why not a module hook:
# any hook sends every module call through torch's slow path, and a global hook makes
# torch.compile warn. One wrapper per patched class checks whether the module being called is
# a traced model (a dict lookup) and otherwise calls straight through.

_models: dict = {}  # id(model) -> _TracedModel, for the models whose forward is timed
_patched_classes: dict = {}  # class -> [its own attribute before (or _ABSENT), models traced]
_ABSENT = object()


def _call_attribute() -> str:
    """The nn.Module attribute every call goes through and a class may override: `_call_impl`
    (torch >= 2.2 calls it from `__call__`, and torch.compile keeps `__call__` bound), or on an
    older torch `__call__` itself, which is `_call_impl` there."""
    from torch.nn import Module

    return "__call__" if Module.__dict__["__call__"] is Module.__dict__["_call_impl"] else "_call_impl"


def _compiling() -> Callable[[], bool]:
    """What the call wrappers ask before timing: True while dynamo traces or torch.export does,
    so traced code calls straight through and nothing of TraceML enters a graph.

    It is torch.compiler.is_compiling, called, never its flag read as an attribute: dynamo
    answers the call with a constant while it traces, but a flag read in a wrapper it inlines
    (a model TraceML timed before the user compiled it) becomes a guard that is never true at
    run time, and every call then recompiled until dynamo's limit sent the model back to eager.
    """
    import torch

    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    if is_compiling is None:  # torch before 2.3
        is_compiling = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return is_compiling or (lambda: False)


def _run_eagerly_under_dynamo(function: Any, callees_too: bool = False) -> None:
    """Have torch.compile run this function's frames as plain Python: never traced, never
    compiled. Its callees are compiled as usual (the model's forward, when this wraps the
    model's call), unless callees_too (TraceML's own bookkeeping, which has nothing to compile).

    torch.compile(model) calls the model's call method under dynamo: without this, dynamo
    would trace the wrapper itself (and, finding is_compiling() true, skip the timing).
    """
    try:
        from torch._C._dynamo import eval_frame

        code = function.__code__
        if hasattr(eval_frame, "set_code_exec_strategy"):
            action = eval_frame._FrameAction
            eval_frame.set_code_exec_strategy(code, eval_frame._FrameExecStrategy(
                action.SKIP, action.SKIP if callees_too else action.DEFAULT))
        elif hasattr(eval_frame, "skip_code") and not callees_too:  # torch before 2.5
            eval_frame.skip_code(code)
    except Exception:  # no dynamo (or no function): nothing to step around
        log.debug("traceml: not marked for dynamo: %r", function, exc_info=True)


def _run_bookkeeping_eagerly() -> None:
    """What the forward wrapper calls on the model's way in and out, kept out of dynamo."""
    for function in (StepProbe.phase_begin, StepProbe.phase_end, StepProbe.note_failure, _batch_size,
                     _token_ids, _count_tokens, _add_real_tokens, _labels_mirror_inputs, _slices_by_one):
        _run_eagerly_under_dynamo(function, callees_too=True)


class _TracedModel:
    """What the probe keeps about one traced model, away from the model itself."""

    __slots__ = ("probe", "model", "token_inputs", "slices_inputs", "labels_mirror_inputs")

    def __init__(self, probe: StepProbe, model: Any):
        self.probe = probe
        self.model = weakref.ref(model)  # for evaluation: the modules of its kind (a copy, a part)
        # Whether this model is given token ids, decided at its first call: the check then
        # costs one attribute read a call, not a look at the inputs.
        self.token_inputs: Optional[bool] = None
        # How many of them it trains on (see _count_tokens), each decided once: whether it
        # slices its ids by one inside (its output is one shorter), and whether its labels
        # are its ids, which it shifts by one inside.
        self.slices_inputs = False
        self.labels_mirror_inputs: Optional[bool] = None


def _timed_call(original: Callable[..., Any], tensor_type: type, compiling: Any) -> Callable[..., Any]:
    """The class's call method, timing the outermost call of a traced model as forward (or,
    between steps with gradients off, as evaluation)."""
    import torch

    grad_enabled = torch.is_grad_enabled

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        traced = _models.get(id(self))
        if traced is None or compiling():
            return original(self, *args, **kwargs)
        return _call_timed_in_general(original, traced, traced.probe, self, args, kwargs, tensor_type, grad_enabled)

    call.__wrapped__ = original  # type: ignore[attr-defined]
    _run_eagerly_under_dynamo(call)
    _run_eagerly_under_dynamo(_call_timed_in_general)
    if fast_path is None:
        return call
    # The compiled timer does call's common case and hands it every other. It sits behind
    # a Python function, read by dynamo as call is (a C callable would break its graphs).
    timer = fast_path.Timer(fast_path.MODEL_CALL, original, call, models=_models, grad_enabled=grad_enabled,
                            tensor_type=tensor_type, batch_size=_batch_size)

    def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if compiling():
            return original(self, *args, **kwargs)
        return timer(self, *args, **kwargs)

    timed_call.__wrapped__ = original  # type: ignore[attr-defined]
    _run_eagerly_under_dynamo(timed_call)
    return timed_call


def _call_timed_in_general(original: Callable[..., Any], traced: _TracedModel, probe: StepProbe, model: Any,
                           args: tuple, kwargs: dict, tensor_type: type, grad_enabled: Callable[[], bool]) -> Any:
    """_timed_call's call: every call of a traced model in Python, and, where the compiled
    timer stands in front, every call but a plain step's outermost one (inside another phase,
    outside the steps, the first call, token inputs, on CUDA, a deep-dive step)."""
    start_ns = probe.phase_begin(FORWARD)
    first_token_call = False  # how many tokens it trains is read once its output is known
    if start_ns:
        probe.sums[FORWARD_CALLS] += 1
        probe.sums[SAMPLES] += _batch_size(args, kwargs, tensor_type)
        if traced.token_inputs is None:
            traced.token_inputs = first_token_call = _token_ids(args, kwargs, tensor_type) is not None
        elif traced.token_inputs:
            _count_tokens(probe, traced, model, args, kwargs, tensor_type)
    elif not probe.in_step and not grad_enabled() and not probe.in_evaluation and _evaluation is not None:
        return _evaluation.model_called(original, model, args, kwargs)  # evaluation
    try:
        if probe.layers_active and probe.layers.active:  # a deep-dive step: count saved tensors
            with probe.layers.saved_tensors_context():
                result = original(model, *args, **kwargs)
        else:
            result = original(model, *args, **kwargs)
    except BaseException:
        probe.note_failure(FORWARD)
        raise
    finally:
        if start_ns:
            probe.phase_end(FORWARD, start_ns)
    if first_token_call:
        traced.slices_inputs = _slices_by_one(result, _token_ids(args, kwargs, tensor_type), tensor_type)
        _count_tokens(probe, traced, model, args, kwargs, tensor_type)
    return result


class _ModelHandle:
    """Stops timing one model; its class gets its own call method back when no traced model of
    that class is left (taken out, or garbage-collected)."""

    def __init__(self, model: Any, compiled_call: Any = None):
        self._model_id = id(model)
        self._class = type(model)
        self._model = weakref.ref(model)
        self._compiled_call = compiled_call  # (timed, its own) when model.compile() came first
        # The entry goes with the model, so a new object reusing its id() is not taken for it.
        self._finalizer = weakref.finalize(model, _forget, self._model_id, self._class)

    def remove(self) -> None:
        model = self._model()
        if model is not None and self._compiled_call is not None:
            timed, own = self._compiled_call
            if model.__dict__.get("_compiled_call_impl") is timed:
                model._compiled_call_impl = own
        self._finalizer()  # runs _forget once, now or never again


def _forget(model_id: int, cls: type) -> None:
    if _models.pop(model_id, None) is None:
        return
    entry = _patched_classes.get(cls)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _patched_classes[cls]
        attribute = _call_attribute()
        if entry[0] is _ABSENT:
            delattr(cls, attribute)
        else:
            setattr(cls, attribute, entry[0])


def hook_model(probe: StepProbe, model: Any) -> List[Any]:
    """Time the outermost call of this model as forward and count the samples it is given."""
    import torch

    if id(model) in _models:
        return []
    cls = type(model)
    attribute = _call_attribute()
    entry = _patched_classes.get(cls)
    if not _patched_classes:
        _run_bookkeeping_eagerly()
    if entry is None:
        entry = _patched_classes[cls] = [cls.__dict__.get(attribute, _ABSENT), 0]
        inherited = getattr(cls, attribute)
        inherited = getattr(inherited, "traceml_original", inherited)  # not a first-call wait
        setattr(cls, attribute, _timed_call(inherited, torch.Tensor, _compiling()))
    entry[1] += 1
    _models[id(model)] = _TracedModel(probe, model)
    _time_ddp_collectives(probe, model)
    _time_sharded_collectives(probe, model)
    return [_ModelHandle(model, _time_compiled_call(model, torch.Tensor))]


def _time_compiled_call(model: Any, tensor_type: type) -> Any:
    """model.compile() before TraceML saw the model: nn.Module calls the compiled call it keeps
    on the instance, never the class's call method. Timed there instead (torch drops that
    attribute from pickles and copies, so it stays invisible). Returns (timed, its own)."""
    own = model.__dict__.get("_compiled_call_impl")
    if own is None:
        return None
    timed = _timed_call(lambda _model, *args, **kwargs: own(*args, **kwargs), tensor_type,
                        _compiling()).__get__(model)
    model._compiled_call_impl = timed
    return timed, own


def on_first_module_call(start: Callable[[Any], None],
                         wanted: Callable[[Any], bool] = lambda module: True) -> None:
    """Call start(module) at the first call of a module that `wanted` accepts, then step aside.

    For steps inferred without a model given (zero-code mode, the Trace API, Lightning): the
    model to time, and its device, are learned from the first call. Until then nn.Module's own
    call method is replaced (not a global hook, which torch.compile warns about); it is
    restored before start() runs, so whatever start() patches wraps the original. In a forked
    DataLoader worker it is only restored; code that dynamo traces calls straight through.
    One such wait at a time: a new one replaces the one before.
    """
    from torch.nn import Module

    disarm_first_call()
    attribute = _call_attribute()
    original = Module.__dict__[attribute]
    compiling = _compiling()
    process = os.getpid()
    passed: dict = {}  # id -> weakref of each module `wanted` turned down: asked once, not per call

    def first_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if compiling() or Module.__dict__.get(attribute) is not first_call:
            return original(self, *args, **kwargs)
        known = passed.get(id(self))
        if known is not None and known() is self:
            return original(self, *args, **kwargs)
        if os.getpid() != process:
            disarm_first_call()
            return original(self, *args, **kwargs)
        try:
            accepted = wanted(self)
        except Exception:  # a module that cannot say what it holds is not the model
            accepted = False
        if not accepted:
            passed[id(self)] = weakref.ref(self)
            return original(self, *args, **kwargs)
        disarm_first_call()
        try:
            start(self)
        except Exception:
            log.warning("traceml: could not start tracing at the first module call; "
                        "the script runs untraced", exc_info=True)
        return getattr(type(self), attribute)(self, *args, **kwargs)  # timed, if start() hooked it

    first_call.traceml_original = original  # type: ignore[attr-defined]
    _run_eagerly_under_dynamo(first_call)
    for bookkeeping in (start, wanted, disarm_first_call):  # the model's first call is compiled
        _run_eagerly_under_dynamo(bookkeeping, callees_too=True)
    def restore() -> None:
        if Module.__dict__.get(attribute) is first_call:  # not if someone replaced it since
            setattr(Module, attribute, original)

    setattr(Module, attribute, first_call)
    _armed.append(restore)


_armed: List[Callable[[], None]] = []  # how to restore nn.Module while a first call is awaited


def disarm_first_call() -> None:
    """Stop waiting for a first module call (an explicit trace_step decides, or detach)."""
    while _armed:
        _armed.pop()()


def trainable(module: Any) -> bool:
    """A module that holds a parameter to train (not a loss, an activation or a frozen net)."""
    return any(parameter.requires_grad for parameter in module.parameters())


def owner_of(parameter_ids: set) -> Callable[[Any], bool]:
    """Accepts a module holding any of these parameters (by id)."""
    return lambda module: any(id(parameter) in parameter_ids for parameter in module.parameters())


_ddp_models: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the traced DDP models


def _time_ddp_collectives(probe: StepProbe, model: Any) -> None:
    """Under DDP, backward splits into this rank's own compute and its wait for the others'
    all-reduce (the straggler is the rank that waits least): see _when_gradients_done.

    No comm hook: any Python comm hook (torch's own allreduce_hook too) costs each bucket tens
    of µs (benchmarks/overhead.py), and DDP keeps its C++ all-reduce only without one.
    """
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed support
        return
    if isinstance(model, DistributedDataParallel):
        _ddp_models.add(model)
        probe.comm_timed = True


def _time_sharded_collectives(probe: StepProbe, model: Any) -> None:
    """Under FSDP: each phase's wait in the all-gathers and reduce-scatters (on the CPU), and
    the memory ledger's all-gathered peak."""
    try:
        from traceml.probe.sharded import time_collectives

        time_collectives(probe, model, _replace, _compiling(), getattr(probe.sender, "ledger", None))
    except Exception:  # torch's internals moved: no collective wait, the steps as they were
        log.warning("traceml: FSDP's collectives are not timed", exc_info=True)


def _when_gradients_done(probe: StepProbe, args: tuple, kwargs: dict) -> Any:
    """Have probe.note_gradients_done run once this backward has computed every gradient: a
    final callback queued with the autograd engine from a hook on the graph's root, which runs
    first. Final callbacks run in the order queued once the graph is done, and DDP queues its
    own (which waits for the all-reduce) when its last bucket is ready, so after this one.
    Returns the hook's handle, removed after backward (the graph may be kept and run again);
    None when no DDP model reduces in this backward (no_sync, gradient accumulation)."""
    import torch

    if not any(model.require_backward_grad_sync for model in _ddp_models):
        return None
    tensors = args[0] if args else kwargs.get("tensors")
    root = tensors if isinstance(tensors, torch.Tensor) else next(iter(tensors or ()), None)
    node = getattr(root, "grad_fn", None)
    if node is None:
        return None
    queue_callback = torch.autograd.Variable._execution_engine.queue_callback

    def at_backward_start(grad_outputs: Any) -> None:
        queue_callback(probe.note_gradients_done)

    return node.register_prehook(at_backward_start)


def _token_ids(args: tuple, kwargs: dict, tensor_type: type) -> Any:
    """The token ids a model is given: input_ids, or an integer (batch, length) first input."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], tensor_type):
        ids = args[0]
    if not isinstance(ids, tensor_type) or ids.is_floating_point() or ids.dim() != 2:
        return None
    return ids


IGNORED_LABEL = -100  # the label torch's cross_entropy (and so Hugging Face's losses) leaves out


def _count_tokens(probe: StepProbe, traced: _TracedModel, model: Any, args: tuple, kwargs: dict,
                  tensor_type: type) -> None:
    """The tokens a step trains on: of the token ids (batch, length) a call is given, the
    positions a next token is predicted for, and the real ones among them.
    - labels= the ids (Hugging Face's causal LMs, which shift them by one inside): batch x
      (length - 1), the real ones those whose label is not -100 (padding, a masked prompt);
    - ids sliced by one inside the model (fed a (batch, length + 1) chunk; seen from its
      output, one shorter): batch x (length - 1), the real ones per attention_mask;
    - else (inputs and targets given apart, nanoGPT's model(x, y)): all the ids given, the real
      ones per attention_mask.
    A count on the device (a mask's or the labels' sum) is copied to pinned host memory without
    waiting; the step's record reads it once the step is done."""
    ids = _token_ids(args, kwargs, tensor_type)
    if ids is None:
        return
    labels = kwargs.get("labels") if kwargs else None
    if isinstance(labels, tensor_type) and labels.shape == ids.shape:
        if traced.labels_mirror_inputs is None:
            traced.labels_mirror_inputs = _labels_mirror_inputs(model, ids, labels)
        if traced.labels_mirror_inputs:
            probe.sums[TOKENS] += ids.shape[0] * (ids.shape[1] - 1)
            _add_real_tokens(probe.sums, (labels[:, 1:] != IGNORED_LABEL).sum(), labels.is_cpu)
            return
    if traced.slices_inputs:
        probe.sums[TOKENS] += ids.shape[0] * (ids.shape[1] - 1)
    else:
        probe.sums[TOKENS] += ids.numel()
    mask = kwargs.get("attention_mask") if kwargs else None
    if isinstance(mask, tensor_type):
        _add_real_tokens(probe.sums, (mask[:, 1:] if traced.slices_inputs else mask).sum(), mask.is_cpu)


def _add_real_tokens(sums: list, count: Any, on_cpu: bool) -> None:
    if on_cpu:
        sums[REAL_TOKENS] = (sums[REAL_TOKENS] or 0) + int(count)
        return
    if sums[TOKEN_COPIES] is None:
        sums[TOKEN_COPIES] = []
    sums[TOKEN_COPIES].append(count.to("cpu", non_blocking=True))
    if sums[REAL_TOKENS] is None:
        sums[REAL_TOKENS] = 0


def _labels_mirror_inputs(model: Any, ids: Any, labels: Any) -> bool:
    """Whether a model's labels are its own ids (where not -100): then it trains on them shifted
    by one (trained unshifted, they would teach it to copy its input). Not for an encoder-
    decoder, whose labels are its decoder's. Asked once a model: one look at the values."""
    try:
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        if labels is ids:
            return True
        kept = labels != IGNORED_LABEL
        return bool(((labels == ids) | ~kept).all())
    except Exception:  # labels we cannot compare: counted as the ids given
        return False


def _slices_by_one(result: Any, ids: Any, tensor_type: type) -> bool:
    """Whether a model's output (its logits: the tensor, the first of a tuple, `logits` of a
    dict or ModelOutput) is one position shorter than its ids: it predicts each next token of a
    chunk it slices inside. A model that returns only its loss cannot be seen doing so."""
    try:
        if isinstance(result, dict):
            result = result.get("logits")
        elif isinstance(result, (tuple, list)):
            result = next((value for value in result if isinstance(value, tensor_type)), None)
        return (ids is not None and isinstance(result, tensor_type) and result.dim() >= 2
                and result.shape[0] == ids.shape[0] and result.shape[1] == ids.shape[1] - 1)
    except Exception:
        return False


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
        try:
            tb = _as_without_traceml(exc, tb)
        except Exception:  # the traceback as it came, rather than none
            log.debug("traceml: traceback left as it was", exc_info=True)
        original_excepthook(exc_type, exc, tb)

    def exit(status: Any = None) -> None:
        probe.exit_code = status if isinstance(status, int) else (0 if status is None else 1)
        original_exit(status)

    _replace(sys, "excepthook", excepthook)
    _replace(sys, "exit", exit)
    _flush_on_sigterm(probe)


_TRACEML_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _as_without_traceml(exc: Any, tb: Any) -> Any:
    """The traceback of an error leaving the script, and of the errors chained to it, as it would
    be without TraceML: the frames an error only passed through on its way out of TraceML's
    wrappers (the model's call) are left out. An error raised inside TraceML keeps every frame."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = _passed_through_left_out(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    return _passed_through_left_out(tb)


def _passed_through_left_out(tb: Any) -> Any:
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if not entries or entries[-1].tb_frame.f_code.co_filename.startswith(_TRACEML_DIR):
        return entries[0] if entries else None
    rebuilt = None
    for entry in reversed([e for e in entries if not e.tb_frame.f_code.co_filename.startswith(_TRACEML_DIR)]):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


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

    def set_sigterm(handler: Any) -> None:
        # A second SIGTERM arriving as the handler changes (the group's, then the one `traceml
        # run` forwards) makes Python raise "ignored due to race condition": never the user's.
        try:
            signal.signal(signal.SIGTERM, handler)
        except (OSError, ValueError):
            pass

    def on_sigterm(signum: int, frame: Any) -> None:
        # A second SIGTERM must not cut the flush short: ignored until it is done.
        set_sigterm(signal.SIG_IGN)
        try:
            probe.exit_code = 128 + signum
            probe.finish()
            probe.goodbye(exit_code=probe.exit_code, timeout_s=2.0)
        except Exception:
            pass
        set_sigterm(signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    _undo.append(restore)
