"""The training thread's wait for a batch: DataLoader iterators' __next__ and queue gets, as
the step's input wait, or between steps as the training's or an evaluation's."""
from __future__ import annotations

import functools
import logging
import queue
from threading import get_ident
from typing import TYPE_CHECKING, Any, Optional, Protocol

from traceml.probe.patches.patch import Patch
from traceml.probe.step_state import EVAL_NS, INPUT_WAIT_GAP_NS, INPUT_WAIT_NS, _now_ns, fast_path
from traceml.probe.step import StepProbe

if TYPE_CHECKING:
    from torch.utils.data.dataloader import _BaseDataLoaderIter as LoaderIterator

log = logging.getLogger("traceml")


class IteratorWatch(Protocol):
    """The sender thread's watch of the training's DataLoaders (probe/loaders.py)."""

    def note(self, iterator: LoaderIterator) -> None: ...

    def made_on_thread(self, iterator: LoaderIterator, elapsed_ns: int) -> None: ...


class InputWait(Patch):
    def __init__(self, probe: StepProbe, watch: Optional[IteratorWatch]):
        super().__init__(probe)
        self.watch = watch  # None: iterators are timed, not watched

    def install(self) -> None:
        import torch
        from torch.utils.data import dataloader

        probe, watch, count = self.probe, self.watch, self._count_wait
        grad_enabled = self._grad_enabled = torch.is_grad_enabled
        iterator_class = dataloader._BaseDataLoaderIter
        original_next = iterator_class.__next__
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
                count(_now_ns() - start_ns)

        __next__.__wrapped__ = original_next  # type: ignore[attr-defined]
        # Compiled where built: the same work on the training thread, another thread's call in Python.
        timed_next = __next__ if fast_path is None else fast_path.Timer(
            fast_path.NEXT, original_next, __next__, probe, grad_enabled=grad_enabled)
        if watch is None:
            self.replace(iterator_class, "__next__", timed_next)
        else:
            self._watch_training_iterators(iterator_class, timed_next, watch)
        self._patch_queue_gets()

    def _count_wait(self, elapsed_ns: int) -> None:
        """The training thread's wait for a batch: the step's input wait; between steps, the
        training's (gradients on) or, with gradients off, an evaluation loop's: `outside`, and
        evaluation. (A trainer's evaluation is timed whole.)"""
        probe = self.probe
        if probe.in_step:
            probe.sums[INPUT_WAIT_NS] += elapsed_ns
        elif not probe.in_evaluation:
            probe.window[INPUT_WAIT_GAP_NS if self._grad_enabled() else EVAL_NS] += elapsed_ns

    def _patch_queue_gets(self) -> None:
        """The training thread's block on a queue.Queue that another thread fills (a prefetching
        thread's buffer: MONAI's ThreadDataLoader, a hand-written prefetcher) is its input wait,
        split as the DataLoader's. Other threads' gets are theirs, and one inside a timed
        DataLoader __next__ (the pin-memory thread's queue) is that wait already."""
        probe, count = self.probe, self._count_wait
        original_get = queue.Queue.get

        @functools.wraps(original_get)
        def get(self: Any, block: bool = True, timeout: Optional[float] = None) -> Any:
            if get_ident() != probe.training_thread or probe.fetching:
                return original_get(self, block, timeout)
            start_ns = _now_ns()
            try:
                return original_get(self, block, timeout)
            finally:
                count(_now_ns() - start_ns)

        self.replace(queue.Queue, "get", get)

    def _watch_training_iterators(self, iterator_class: Any, timed_next: Any, watch: IteratorWatch) -> None:
        """Note each training iterator for the sender thread's watch once: when it is made, or,
        for one made before TraceML attached, at its first batch after. Nothing of this runs
        per batch."""
        probe, grad_enabled = self.probe, self._grad_enabled

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
        self.replace(iterator_class, "__next__", first_next)
        original_init = iterator_class.__init__

        def __init__(self: Any, *args: object, **kwargs: object) -> None:
            original_init(self, *args, **kwargs)
            if training():  # an evaluation's iterator is not the training's input
                _note_iterator(watch, self)

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        self.replace(iterator_class, "__init__", __init__)


def _note_iterator(watch: IteratorWatch, iterator: LoaderIterator) -> None:
    """Hand a training iterator to the sender thread's watch (probe.loaders), once."""
    try:
        watch.note(iterator)
    except Exception:  # a loader we cannot watch: INPUT_BOUND's advice without its figures
        log.debug("traceml: a DataLoader iterator is not watched", exc_info=True)
