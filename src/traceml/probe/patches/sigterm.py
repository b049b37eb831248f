"""SIGTERM: what is buffered is sent before the process dies of it."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

from traceml.probe.patches.patch import Patch
from traceml.probe.step import StepProbe


class SigtermFlush(Patch):
    """A launcher stopping the ranks (torchrun after one failed, a job's time limit) sends
    SIGTERM, whose default ends Python at once, without atexit: the last records would go
    with it. Where the script left SIGTERM at its default, send what is buffered first, then
    die of the same signal, so the exit status is what it would have been."""

    def __init__(self, probe: StepProbe):
        super().__init__()
        self.probe = probe

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the script handles SIGTERM itself: its handler, its exit, our atexit
        probe = self.probe

        def on_sigterm(signum: int, frame: Any) -> None:
            # A second SIGTERM must not cut the flush short: ignored until it is done.
            _set_sigterm(signal.SIG_IGN)
            try:
                probe.exit_code = 128 + signum
                probe.finish()
                probe.goodbye(exit_code=probe.exit_code, timeout_s=2.0)
            except Exception:
                pass
            _set_sigterm(signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)

        def restore() -> None:
            if signal.getsignal(signal.SIGTERM) is on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

        self.on_remove(restore)


def _set_sigterm(handler: Any) -> None:
    # A second SIGTERM arriving as the handler changes (the group's, then the one `traceml
    # run` forwards) makes Python raise "ignored due to race condition": never the user's.
    try:
        signal.signal(signal.SIGTERM, handler)
    except (OSError, ValueError):
        pass
