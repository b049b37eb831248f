"""Evaluation between steps: a stretch with gradients off in which the model runs, seen from
torch's grad-mode managers, Module.eval and Hugging Face Trainer's evaluate and predict.

A region is a `with` block or a decorated function of torch.no_grad, torch.inference_mode or
torch.set_grad_enabled(False), entered between steps on the training thread; the outermost
one is timed. It is evaluation, all of it (the forwards and the work around them: sampling the
next token, decoding, a metric), when the model runs in it:
- a traced model is called (`model(x)`, a `generate()` calling `self(...)`), or
- the first module with parameters called in it is of the model's kind: it holds a traced
  model's parameters (an inner `self.net` a `generate()` loop calls, a submodule), or its
  parameters' shapes, in order, are a run of a traced model's (a copy of the model or of a part
  of it: an EMA or SWA copy made with deepcopy, which shares no parameter with it).
A region in which no such module runs is not evaluation: an EMA update (arithmetic on the
weights, no module called), metrics, someone else's frozen encoder applied to the batch.
A traced model called with gradients off outside any region is a region of its own.
An evaluation runs from a module's `eval()` between steps (else its first region) to its last
region before the next `eval()` or step: a no_grad region a batch (Hugging Face's no_trainer
examples) fetches its batches between them, and that is evaluation too (a save stays a save).

Cost: inside a step, entering and leaving a region reads `in_step` and one attribute; no module
call pays anything, ever. Between steps a region puts a global forward pre-hook in place that
takes itself out at the first module with parameters (or at the region's end).

torch.compile: compiled code is guarded on the global hooks there are; code entered with ours in
place would be compiled again without it (and torch.compile's module wrapper warns of global
hooks). So ours is taken out before any compiled code runs: where torch's module wrapper asks
whether there are global hooks, and where every compiled function is entered (the callback it
sets), both looked up by torch at each call; and, should neither be found, at each compilation's
start. A region whose first module is compiled code is evaluation only if a traced model is
called in it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import weakref
from threading import get_ident
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, ParamSpec, Tuple, Type, TypeVar

from traceml.probe.patches.dynamo import compiling
from traceml.probe.patches.imports import WhenImported
from traceml.probe.patches.patch import Patch
from traceml.probe.step_state import CHECKPOINT_BETWEEN_NS, EVAL_NS, INPUT_WAIT_GAP_NS, _now_ns
from traceml.probe.step import StepProbe

if TYPE_CHECKING:
    from types import ModuleType, TracebackType

    from torch import Tensor
    from torch.nn import Module
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger("traceml")
P = ParamSpec("P")  # a wrapped function's parameters ...
R = TypeVar("R")  # ... and what it returns, passed through

# Where torch looks up, at each call, what runs before compiled code (see the module's text).
BEFORE_COMPILED_CODE = (("torch.nn.modules.module", "_has_any_global_hook"),
                        ("torch._dynamo.eval_frame", "_callback_from_stance"))


def _shapes(parameters: Iterable[Tensor]) -> str:
    """';4x8;8;' for a (4, 8) weight and an (8,) bias: a run of shapes is a substring."""
    return ";" + ";".join("x".join(map(str, parameter.shape)) for parameter in parameters) + ";"


def of_the_model(module: Module, model: Module) -> bool:
    """Whether module holds the model's parameters, or is a copy of it or of a part of it."""
    model_parameters = list(model.parameters())
    held = {id(parameter) for parameter in model_parameters}
    own = list(module.parameters())
    return any(id(parameter) in held for parameter in own) or _shapes(own) in _shapes(model_parameters)


class EvaluationRegions(Patch):
    """The region open between steps, if any, and whether the model has run in it."""

    def __init__(self, probe: StepProbe, when_imported: WhenImported, traced_models: Callable[[], List[Module]]):
        super().__init__(probe)
        self.when_imported, self.traced_models = when_imported, traced_models
        self.active = False  # installed: a traced model's call between steps reports to it
        self.owner: object = None  # the context manager (or the model call) whose region is open
        self.qualified = False  # the model ran in it: evaluation
        self._step = -1  # the step index it opened at: a step started since drops it
        self._start_ns = self._eval_ns_before = 0
        # Where a region closing in the same window extends the evaluation from: (the window,
        # its input wait, saves and evaluation then, when, whether a region closed then).
        self._last_closed: tuple = (None,)
        self._hook: Optional[RemovableHandle] = None  # the global pre-hook's handle, while it waits for a first module
        self._swapped: List[Tuple[Optional[ModuleType], str, object, object]] = []  # (module, name, torch's, ours) meanwhile
        self._process = os.getpid()
        # module -> of the model's kind; made anew when the traced models change
        self._verdicts: weakref.WeakKeyDictionary[Module, bool] = weakref.WeakKeyDictionary()
        self._verdicts_for: tuple = ()

    def install(self) -> None:
        """Time no-grad regions between steps in which the model runs as evaluation: torch's
        grad-mode context managers' enter and exit, on their classes, and Module.eval."""
        import torch
        from torch.autograd import grad_mode
        from torch.nn.modules import module as torch_module

        self._register_hook = torch_module.register_module_forward_pre_hook
        self._is_compiling = compiling()
        self._grad_enabled = torch.is_grad_enabled
        for manager in (grad_mode.no_grad, grad_mode.inference_mode, grad_mode.set_grad_enabled):
            self.replace(manager, "__enter__", self.entering(manager.__enter__))
            self.replace(manager, "__exit__", self.leaving(manager.__exit__))
        self.replace(torch.nn.Module, "eval", self.eval_called(torch.nn.Module.eval))
        self.active = True
        self.when_imported("torch._dynamo.callback", self._stop_watching_at_compilations)
        self.on_remove(self.stop)
        self.when_imported("transformers.trainer", self._not_training_in_trainer_evaluation)

    def _stop_watching_at_compilations(self, callbacks: ModuleType) -> None:
        """What torch compiles is traced with no hook in place (see the module's text)."""
        handler = callbacks.callback_handler
        handler.register_start_callback(self.compilation_started)

        def remove() -> None:
            with contextlib.suppress(ValueError):  # torch._dynamo.reset() took it out already
                handler.remove_start_callback(self.compilation_started)

        self.on_remove(remove)

    def _not_training_in_trainer_evaluation(self, module: ModuleType) -> None:
        """Hugging Face Trainer's evaluation fetches its batches with gradients on: its DataLoader
        waits are evaluation, not the training's input, with or without the integration."""
        for name, wrapped in evaluation_wrapped(module.Trainer).items():
            self.replace(module.Trainer, name, wrapped)

    # -- the context managers' __enter__ and __exit__ ------------------------------------------
    def entering(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        probe = self.probe

        @functools.wraps(original)
        def __enter__(manager: object) -> Any:
            entered = original(manager)
            if not probe.in_step:  # inside a step: nothing more
                self.open(manager)
            return entered

        return __enter__

    def leaving(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def __exit__(manager: object, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                     tb: Optional[TracebackType]) -> Any:
            suppressed = original(manager, exc_type, exc, tb)
            if manager is self.owner:
                self.close()
            return suppressed

        return __exit__

    def open(self, owner: object, qualified: bool = False) -> bool:
        """A region starts, unless one is open (nested: the outermost is timed), gradients are
        on, a trainer's evaluation is timed whole, or this is not the training thread. True
        when it opened."""
        probe = self.probe
        try:
            if (self.owner is not None and self._step == probe.step_index) or probe.in_evaluation:
                return False
            if self._grad_enabled() or get_ident() != probe.training_thread or os.getpid() != self._process:
                return False
            self._stop_watching()  # a region left open in an earlier window (never exited)
            self.owner, self.qualified, self._step = owner, qualified, probe.step_index
            self._eval_ns_before = probe.window[EVAL_NS]
            if not qualified:
                self._watch()
            self._start_ns = _now_ns()
            return True
        except Exception:  # less telemetry, never the user's run
            log.debug("traceml: an evaluation region was not timed", exc_info=True)
            self.owner = None
            self._stop_watching()
            return False

    def evaluating(self) -> bool:
        """A region is open and the model has run in it (read by the stall pulse, another thread)."""
        return self.owner is not None and self.qualified and not self.probe.in_step

    def close(self) -> None:
        """The region ends: evaluation when the model ran in it and no step started meanwhile.
        What was counted as evaluation inside it (the loader's waits) is part of it, not more."""
        probe = self.probe
        self.owner = None
        self._stop_watching()
        if not self.qualified or probe.in_step or probe.step_index != self._step:
            return
        window, now_ns, last = probe.window, _now_ns(), self._last_closed
        if last[0] is window:  # the evaluation since its eval() or last region: its fetches too
            window[INPUT_WAIT_GAP_NS] = last[1]
            window[EVAL_NS] = last[3] + max(0, now_ns - last[4] - (window[CHECKPOINT_BETWEEN_NS] - last[2]))
        else:
            window[EVAL_NS] += max(0, now_ns - self._start_ns - (window[EVAL_NS] - self._eval_ns_before))
        if last[0] is not window or not last[5]:
            probe.count_planned(1)
        self._extend_from(window, now_ns, True)

    def _extend_from(self, window: list, now_ns: int, region_closed: bool) -> None:
        self._last_closed = (window, window[INPUT_WAIT_GAP_NS], window[CHECKPOINT_BETWEEN_NS], window[EVAL_NS],
                             now_ns, region_closed)

    def eval_called(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Module.eval: between steps, it starts an evaluation (its first batch's fetch)."""

        @functools.wraps(original)
        def eval(module: Module) -> Any:
            try:
                if not self.probe.in_step and not self._is_compiling() and get_ident() == self.probe.training_thread:
                    self._extend_from(self.probe.window, _now_ns(), False)
            except Exception:  # TraceML's fault costs its figure, never the user's eval()
                log.debug("traceml: an evaluation's start was not noted", exc_info=True)
            return original(module)

        return eval

    def model_called(self, call: Callable[..., Any], model: Module, args: tuple, kwargs: dict) -> Any:
        """A traced model called between steps with gradients off: the open region is
        evaluation, or the call is a region of its own."""
        if self.owner is not None and self._step == self.probe.step_index:
            self.qualified = True
            self._stop_watching()
            return call(model, *args, **kwargs)
        token = object()
        if not self.open(token, qualified=True):
            return call(model, *args, **kwargs)
        try:
            return call(model, *args, **kwargs)
        finally:
            if self.owner is token:
                self.close()

    # -- the first module with parameters called in the region ---------------------------------
    def _first_module_call(self, module: Module, args: Tuple[object, ...]) -> None:
        if self._is_compiling() or get_ident() != self.probe.training_thread:
            return None  # code torch.compile traces, or another thread's module: not this region's
        try:
            if self.owner is None or self.probe.in_step:
                self._stop_watching()
            elif next(module.parameters(), None) is not None:  # parameterless modules do not decide
                self._stop_watching()
                self.qualified = self._of_the_models(module)
        except Exception:  # a module that cannot say what it holds is not the model
            log.debug("traceml: could not tell whether a module is the model's", exc_info=True)
            self._stop_watching()
        return None  # the module's inputs as they are

    def _of_the_models(self, module: Module) -> bool:
        models = [model for model in self.traced_models() if model is not None]
        traced = tuple(id(model) for model in models)
        if traced != self._verdicts_for:
            self._verdicts, self._verdicts_for = weakref.WeakKeyDictionary(), traced
        try:
            known = self._verdicts.get(module)
        except TypeError:  # a module that is not hashable: asked each time
            return any(of_the_model(module, model) for model in models)
        if known is None:
            known = self._verdicts[module] = any(of_the_model(module, model) for model in models)
        return known

    # -- the hook, and taking it out before compiled code runs ---------------------------------
    def _watch(self) -> None:
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if eval_frame is not None and not hasattr(eval_frame, "_callback_from_stance"):
            return  # a torch whose compiled code cannot be seen coming: no hook
        self._hook = self._register_hook(self._first_module_call)
        for module_name, name in BEFORE_COMPILED_CODE:
            module = sys.modules.get(module_name)
            theirs = getattr(module, name, None)
            if theirs is not None:
                ours = self._stopping_first(theirs)
                setattr(module, name, ours)
                self._swapped.append((module, name, theirs, ours))

    def _stopping_first(self, theirs: Callable[P, R]) -> Callable[P, R]:
        def before_compiled_code(*args: P.args, **kwargs: P.kwargs) -> R:
            self._stop_watching()
            return theirs(*args, **kwargs)

        return before_compiled_code

    def compilation_started(self, *args: object) -> None:
        """torch's compile-start callback: what compiles now is traced without the hook."""
        self._stop_watching()

    def _stop_watching(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        while self._swapped:
            module, name, theirs, ours = self._swapped.pop()
            if module.__dict__.get(name) is ours:  # not if someone replaced it since
                setattr(module, name, theirs)

    def stop(self) -> None:
        """TraceML is taken out: no region open, no hook left behind."""
        self.active, self.owner, self._last_closed = False, None, (None,)
        self._stop_watching()


def evaluation_wrapped(trainer_class: Any) -> Dict[str, Callable[..., Any]]:
    """Trainer's evaluation entry points (evaluate, predict) that are not wrapped yet, wrapped
    (init() sets them for good; zero-code mode for as long as the run is traced)."""
    return {name: not_training(getattr(trainer_class, name)) for name in ("evaluate", "predict")
            if not getattr(getattr(trainer_class, name), "_traceml_not_training", False)}


def not_training(method: Callable[P, R]) -> Callable[P, R]:
    """Wrap an evaluation entry point: all of it is evaluation (the model's calls, the loader's
    waits, Trainer's own work around them), none of it the training's input wait."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
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
