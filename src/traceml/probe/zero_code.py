"""Zero-code mode: `traceml run` starts every script through this module, so a script that never
imports traceml is still traced, with steps inferred from `optimizer.step()` (or `backward()`).

    python -m traceml.probe.zero_code train.py --its --args

Nothing is made until the script first calls a module with parameters to train: that module
is the model, its device says CUDA events or the host clock, and the script may still call
trace_step itself, which then decides the steps as usual. Until that call nn.Module's call
method waits for it (patches/first_call.py), and that is all there is.
"""
from __future__ import annotations

import logging
import os
import runpy
import sys
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, List, Optional

if TYPE_CHECKING:
    from traceml.probe.process import StartupFields

log = logging.getLogger("traceml")


# Every module load goes through it: import statements (builtins.__import__ calls it from C),
# importlib.import_module (a lazy registry's walk) and __import__ alike.
_bootstrap: Any = sys.modules["_frozen_importlib"]


class _ImportTimer:
    """importlib's _find_and_load from the script's start to its first step, for the startup
    part of goodput: it times the outermost loads on the script's main thread, then steps
    aside, so the training's imports cost nothing."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.thread = threading.get_ident()
        self.depth = 0
        self.total_ns = self.slowest_ns = 0
        self.slowest_name: Any = None

    def __call__(self, name: str, *args: object) -> Any:
        if self.depth or threading.get_ident() != self.thread:
            return self.original(name, *args)
        self.depth = 1
        start_ns = time.perf_counter_ns()
        try:
            return self.original(name, *args)
        finally:
            self.depth = 0
            elapsed_ns = time.perf_counter_ns() - start_ns
            self.total_ns += elapsed_ns
            if elapsed_ns > self.slowest_ns:
                self.slowest_ns, self.slowest_name = elapsed_ns, name

    def stop(self) -> StartupFields:
        """Step aside (the loader as it was) and say what was timed, as the hello's fields."""
        if _bootstrap._find_and_load is self:
            _bootstrap._find_and_load = self.original
        name = self.slowest_name if isinstance(self.slowest_name, str) else ""
        return {"imports_ms": self.total_ns / 1e6, "slowest_import": name.partition(".")[0]}


def _start_at_first_module_call() -> None:
    from traceml.probe import process, step
    from traceml.probe.patches.first_call import trainable

    def start(module: Any) -> None:
        if step._probe is None:  # else trace_step came first: the script traces itself
            process.infer_steps(device_of=module, model=module)

    process.first_call.arm(start, wanted=trainable)


def main(argv: List[str]) -> None:
    if not argv:
        sys.exit("usage: python -m traceml.probe.zero_code SCRIPT [ARGS ...]")
    script = os.path.abspath(argv[0])  # the script's __file__ and frames, as under `python`
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)  # as `python script.py` would
    try:
        from traceml.probe import process
        from traceml.probe.code_sites import StartupSampler

        # The probe's hello takes the import time and startup's samples so far and stops both
        # (process._startup_so_far).
        process.import_timer = _bootstrap._find_and_load = _ImportTimer(_bootstrap._find_and_load)
        process.startup_sampler = StartupSampler(script)
    except Exception:
        log.debug("traceml: startup timing unavailable", exc_info=True)
    try:  # after the timer: torch's import here is the script's (it finds torch loaded)
        _start_at_first_module_call()
    except Exception:  # no torch: the script runs untraced
        log.warning("traceml: zero-code tracing unavailable", exc_info=True)
    try:
        runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        # The traceback `python script.py` would print: from the script's own frame, without
        # this module's and runpy's above it. Then exit 1, as an uncaught exception does.
        error.with_traceback(_from_frame_of(script, error.__traceback__))  # what is printed
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)
    finally:  # a script that never stepped: sampling its start ends with it
        sampler = getattr(sys.modules.get("traceml.probe.process"), "startup_sampler", None)
        if sampler is not None:
            sampler.stop(0)


def _from_frame_of(script: str, traceback: Optional[TracebackType]) -> Optional[TracebackType]:
    """The traceback from the first frame running the script's code (all of it if none does)."""
    frame = traceback
    while frame is not None and frame.tb_frame.f_code.co_filename != script:
        frame = frame.tb_next
    return frame if frame is not None else traceback


if __name__ == "__main__":
    main(sys.argv[1:])
