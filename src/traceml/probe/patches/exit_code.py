"""The script's exit code, noted on the way out (under plain `python train.py` nobody else knows
it), with an uncaught error printed as it would be without TraceML."""
from __future__ import annotations

import logging
import sys
from typing import Any

from traceml.probe.patches.patch import Patch
from traceml.probe.patches.tracebacks import without_traceml
from traceml.probe.step import StepProbe

log = logging.getLogger("traceml")


class ExitCode(Patch):
    def __init__(self, probe: StepProbe):
        super().__init__()
        self.probe = probe

    def install(self) -> None:
        probe, original_excepthook, original_exit = self.probe, sys.excepthook, sys.exit

        def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
            probe.exit_code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
            try:
                tb = without_traceml(exc, tb)
            except Exception:  # the traceback as it came, rather than none
                log.debug("traceml: traceback left as it was", exc_info=True)
            original_excepthook(exc_type, exc, tb)

        def exit(status: Any = None) -> None:
            probe.exit_code = status if isinstance(status, int) else (0 if status is None else 1)
            original_exit(status)

        self.replace(sys, "excepthook", excepthook)
        self.replace(sys, "exit", exit)
