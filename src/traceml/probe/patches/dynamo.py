"""How TraceML's wrappers stay out of torch.compile: whether dynamo traces now, frames it must
run as plain Python, and the nn.Module attribute every call goes through."""
import logging
from typing import Callable

log = logging.getLogger("traceml")


def call_attribute() -> str:
    """The nn.Module attribute every call goes through and a class may override: `_call_impl`
    (torch >= 2.2 calls it from `__call__`, and torch.compile keeps `__call__` bound), or on an
    older torch `__call__` itself, which is `_call_impl` there."""
    from torch.nn import Module

    return "__call__" if Module.__dict__["__call__"] is Module.__dict__["_call_impl"] else "_call_impl"


def compiling() -> Callable[[], bool]:
    """What the call wrappers ask before timing: True while dynamo traces or torch.export does,
    so traced code calls straight through and nothing of TraceML enters a graph.

    It is torch.compiler.is_compiling, called, never its flag read as an attribute: dynamo
    answers the call with a constant while it traces, but a flag read in a wrapper it inlines
    (a model TraceML timed before the user compiled it) becomes a guard that is never true at
    run time, and every call would recompile until dynamo's limit sends the model back to eager.
    """
    import torch

    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    if is_compiling is None:  # torch before 2.3
        is_compiling = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return is_compiling or (lambda: False)


def run_eagerly_under_dynamo(function: Callable[..., object], callees_too: bool = False) -> None:
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
