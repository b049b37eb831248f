"""The wait for a model's first call: with steps inferred (zero-code mode, the Trace API,
Lightning) the model to time, and its device, are learned when it is first called."""
from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Set

from traceml.probe.patches.dynamo import call_attribute, compiling, run_eagerly_under_dynamo

if TYPE_CHECKING:
    from torch.nn import Module

log = logging.getLogger("traceml")


class FirstModelCall:
    """nn.Module's own call method, replaced while a first call is awaited (not a global hook,
    which torch.compile warns about). One wait at a time: a new one replaces the one before."""

    def __init__(self) -> None:
        self._armed: List[Callable[[], None]] = []  # how to restore nn.Module while a call is awaited

    def arm(self, start: Callable[[Module], None], wanted: Callable[[Module], bool] = lambda module: True) -> None:
        """Call start(module) at the first call of a module that `wanted` accepts, then step aside.

        nn.Module's call method is restored before start() runs, so whatever start() patches
        wraps the original. In a forked DataLoader worker it is only restored; code that dynamo
        traces calls straight through.
        """
        from torch.nn import Module

        self.disarm()
        disarm = self.disarm
        attribute = call_attribute()
        original = Module.__dict__[attribute]
        is_compiling = compiling()
        process = os.getpid()
        passed: dict = {}  # id -> weakref of each module `wanted` turned down: asked once, not per call

        def first_call(self: Any, *args: object, **kwargs: object) -> Any:
            if is_compiling() or Module.__dict__.get(attribute) is not first_call:
                return original(self, *args, **kwargs)
            known = passed.get(id(self))
            if known is not None and known() is self:
                return original(self, *args, **kwargs)
            if os.getpid() != process:
                disarm()
                return original(self, *args, **kwargs)
            try:
                accepted = wanted(self)
            except Exception:  # a module that cannot say what it holds is not the model
                accepted = False
            if not accepted:
                passed[id(self)] = weakref.ref(self)
                return original(self, *args, **kwargs)
            disarm()
            try:
                start(self)
            except Exception:
                log.warning("traceml: could not start tracing at the first module call; "
                            "the script runs untraced", exc_info=True)
            return getattr(type(self), attribute)(self, *args, **kwargs)  # timed, if start() hooked it

        first_call.traceml_original = original  # type: ignore[attr-defined]
        run_eagerly_under_dynamo(first_call)
        for bookkeeping in (start, wanted, disarm):  # the model's first call is compiled
            run_eagerly_under_dynamo(bookkeeping, callees_too=True)

        def restore() -> None:
            if Module.__dict__.get(attribute) is first_call:  # not if someone replaced it since
                setattr(Module, attribute, original)

        setattr(Module, attribute, first_call)
        self._armed.append(restore)

    def disarm(self) -> None:
        """Stop waiting for a first module call (an explicit trace_step decides, or detach)."""
        while self._armed:
            self._armed.pop()()


def trainable(module: Module) -> bool:
    """A module that holds a parameter to train (not a loss, an activation or a frozen net)."""
    return any(parameter.requires_grad for parameter in module.parameters())


def owner_of(parameter_ids: Set[int]) -> Callable[[Module], bool]:
    """Accepts a module holding any of these parameters (by id)."""
    return lambda module: any(id(parameter) in parameter_ids for parameter in module.parameters())
