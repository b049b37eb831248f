"""torch.compile awareness: each compilation's time and step from torch's own compile callbacks
(on the training thread, and only while torch compiles), its code, recompile reason and graph
breaks from torch's compilation metrics (read by the sender thread, only after a compilation).

Nothing here is imported or runs until the script's torch imports `torch._dynamo.callback`
(patches/imports.py): a run that never compiles pays nothing.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from traceml.probe.step_state import COMPILE_NS
from traceml.records import CompileRecord

METRICS_WAIT_S = 2.0  # how long a compilation waits for torch's metrics before it goes without
_TORCH_WRAPPER = os.path.join("_dynamo", "external_utils.py")  # where a compiled module's call lives


class CompileWatch:
    """Compilations of one process, from torch's start and end callbacks to CompileRecords."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self._started: Optional[Tuple[str, str, int]] = None  # (compile_id, trigger, start ns)
        # Ended compilations the sender has not sent yet: (compile_id, trigger, step, start
        # unix s, duration ms, ended monotonic s). Appended on the training thread, taken by
        # the sender's thread (a deque's append and popleft are atomic).
        self.ended: Deque[tuple] = collections.deque()
        self._graph_breaks_seen: Dict[str, int] = {}

    # -- training thread: torch calls these around each compilation ------------------------
    def on_start(self, *args: object) -> None:
        if threading.get_ident() != self.probe.training_thread:
            return
        compile_id, trigger = _describe(args)
        self._started = (compile_id, trigger, time.perf_counter_ns())

    def on_end(self, *args: object) -> None:
        started, self._started = self._started, None
        if started is None or threading.get_ident() != self.probe.training_thread:
            return
        compile_id, trigger, start_ns = started
        probe = self.probe
        elapsed_ns = time.perf_counter_ns() - start_ns
        probe.window[COMPILE_NS] += elapsed_ns
        # The window a compilation falls in: the step in flight, else the one whose gap this
        # is; -1 before the first step (startup).
        step = probe.step_index if probe.in_step else probe.step_index - 1
        self.ended.append((compile_id, trigger, step, probe.unix_s(start_ns), elapsed_ns / 1e6,
                           time.monotonic()))

    # -- sender thread -----------------------------------------------------------------------
    def records(self, final: bool = False) -> List[CompileRecord]:
        """The ended compilations whose details torch has recorded (all of them when final)."""
        if not self.ended:
            return []
        metrics = _compilation_metrics()
        # Read once a dynamo compilation is sent this round: read in a round that then waits
        # for torch's metrics, the breaks would be counted as seen and sent with nothing.
        graph_breaks: Optional[Dict[str, int]] = None
        ready: List[CompileRecord] = []
        while self.ended:
            compile_id, trigger, step, start_unix_s, duration_ms, ended_at = self.ended[0]
            details = metrics.get(compile_id) if trigger == "dynamo" else None
            if trigger == "dynamo" and details is None and not final \
                    and time.monotonic() - ended_at < METRICS_WAIT_S:
                break  # torch records its metrics just after the end callback: next round
            self.ended.popleft()
            code, reason = details if details is not None else ("", "")
            record = CompileRecord(rank=self.probe.rank, step=step, start_unix_s=start_unix_s,
                                   duration_ms=duration_ms, compile_id=compile_id, trigger=trigger,
                                   code=code, recompile_reason=reason)
            if trigger == "dynamo":
                graph_breaks = self._new_graph_breaks() if graph_breaks is None else graph_breaks
                if graph_breaks:
                    record.graph_breaks, record.graph_break_reasons = sum(graph_breaks.values()), list(graph_breaks)
                    graph_breaks = {}
            ready.append(record)
        return ready

    def _new_graph_breaks(self) -> Dict[str, int]:
        """Graph breaks torch counted since the last look, by the first line of their reason."""
        utils = sys.modules.get("torch._dynamo.utils")
        try:
            counted = dict(utils.counters["graph_break"]) if utils is not None else {}
        except Exception:
            return {}
        new: Dict[str, int] = {}
        for reason, count in counted.items():
            added = count - self._graph_breaks_seen.get(reason, 0)
            if added > 0:
                first_line = str(reason).strip().splitlines()[0][:200] if str(reason).strip() else "?"
                new[first_line] = new.get(first_line, 0) + added
            self._graph_breaks_seen[reason] = count
        return new


def install(probe: Any, callback_module: ModuleType) -> Optional[Callable[[], None]]:
    """Register a CompileWatch with torch's compile callbacks; returns how to take it back."""
    handler = getattr(callback_module, "callback_handler", None)
    if handler is None or not hasattr(handler, "register_start_callback"):
        return None  # a torch without compile callbacks: no compile awareness
    watch = CompileWatch(probe)
    handler.register_start_callback(watch.on_start)
    handler.register_end_callback(watch.on_end)
    probe.sender.compile_watch = watch

    def remove() -> None:
        for name, callback in (("remove_start_callback", watch.on_start),
                               ("remove_end_callback", watch.on_end)):
            with contextlib.suppress(Exception):
                getattr(handler, name)(callback)

    return remove


def _describe(args: Tuple[Any, ...]) -> Tuple[str, str]:
    """(compile_id, trigger) from a callback's arguments (none in older torch)."""
    if not args:
        return "", "dynamo"
    callback_args = args[0]
    trigger = getattr(getattr(callback_args, "callback_trigger", None), "name", "DYNAMO")
    return str(getattr(callback_args, "compile_id", "") or ""), trigger.lower()


def _compilation_metrics() -> Dict[str, Tuple[str, str]]:
    """compile_id -> (code, recompile reason) of the forward compilations torch recorded."""
    utils = sys.modules.get("torch._dynamo.utils")
    getter = getattr(utils, "get_compilation_metrics", None)
    if getter is None:
        return {}
    try:
        entries = list(getter())
    except Exception:
        return {}
    found: Dict[str, Tuple[str, str]] = {}
    for entry in entries:
        compile_id, name = getattr(entry, "compile_id", None), getattr(entry, "co_name", None)
        if compile_id is None or name is None:
            continue  # a backward's entry: no code of its own
        filename = getattr(entry, "co_filename", "") or ""
        if filename.endswith(_TORCH_WRAPPER):
            code = "a compiled module's forward"
        else:
            code = f"{name} ({os.path.basename(filename)}:{getattr(entry, 'co_firstlineno', '?')})"
        found[str(compile_id)] = (code, str(getattr(entry, "recompile_reason", "") or ""))
    return found
