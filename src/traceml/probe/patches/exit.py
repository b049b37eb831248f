"""How the run ends: its exit code noted (under plain `python train.py` nobody else knows it), an
uncaught error printed as it would be without TraceML, and SIGTERM's flush of what is buffered."""
import contextlib
import logging
import os
import signal
import sys
import threading
import types
from typing import Optional, Type, Union

from traceml.probe.patches.patch import Patch

log = logging.getLogger("traceml")
_TRACEML_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


class ExitCode(Patch):
    def install(self) -> None:
        probe, original_excepthook, original_exit = self.probe, sys.excepthook, sys.exit

        def excepthook(exc_type: Type[BaseException], exc: BaseException, tb: Optional[types.TracebackType]) -> None:
            probe.exit_code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
            try:
                tb = without_traceml(exc, tb)
            except Exception:  # the traceback as it came, rather than none
                log.debug("traceml: traceback left as it was", exc_info=True)
            original_excepthook(exc_type, exc, tb)

        def exit(status: Union[str, int, None] = None) -> None:
            probe.exit_code = status if isinstance(status, int) else (0 if status is None else 1)
            original_exit(status)

        self.replace(sys, "excepthook", excepthook)
        self.replace(sys, "exit", exit)


def without_traceml(exc: Optional[BaseException], tb: Optional[types.TracebackType]) -> Optional[types.TracebackType]:
    """The traceback of an error leaving the script, and of the errors chained to it, as it would
    be without TraceML: the frames an error only passed through on its way out of TraceML's
    wrappers (the model's call) are left out. An error raised inside TraceML keeps every frame."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = _passed_through_left_out(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    return _passed_through_left_out(tb)


def _passed_through_left_out(tb: Optional[types.TracebackType]) -> Optional[types.TracebackType]:
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


class SigtermFlush(Patch):
    """A launcher stopping the ranks (torchrun after one failed, a job's time limit) sends
    SIGTERM, whose default ends Python at once, without atexit: the last records would go
    with it. Where the script left SIGTERM at its default, send what is buffered first, then
    die of the same signal, so the exit status is what it would have been."""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the script handles SIGTERM itself: its handler, its exit, our atexit
        probe = self.probe

        def on_sigterm(signum: int, frame: Optional[types.FrameType]) -> None:
            # A second SIGTERM must not cut the flush short: ignored until it is done.
            _set_sigterm(signal.SIG_IGN)
            with contextlib.suppress(Exception):
                probe.exit_code = 128 + signum
                probe.finish()
                probe.goodbye(exit_code=probe.exit_code, timeout_s=2.0)
            _set_sigterm(signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)

        def restore() -> None:
            if signal.getsignal(signal.SIGTERM) is on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

        self.on_remove(restore)


def _set_sigterm(handler: signal.Handlers) -> None:
    # A second SIGTERM arriving as the handler changes (the group's, then the one `traceml
    # run` forwards) makes Python raise "ignored due to race condition": never the user's.
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signal.SIGTERM, handler)
