"""An uncaught error's traceback as it would be without TraceML: the frames of its wrappers left out."""
from __future__ import annotations

import os
import types
from typing import Any

_TRACEML_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def without_traceml(exc: Any, tb: Any) -> Any:
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
