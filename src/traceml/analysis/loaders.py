"""The training DataLoader's figures, from its sender's LoaderSamples: how it is set up, and how
its batches came: per batch, the worker processes' CPU time and the training's wait for it, and
how often a batch was already made and waiting, and, iterated on a thread ahead of the training,
that thread's time per batch. INPUT_BOUND's advice reads them."""
from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Sequence, Tuple, Union

import msgspec

from traceml.analysis.rollup import Window
from traceml.records import Evidence, LoaderSample, RankHello, window_end_unix_s

MIN_BATCHES = 20  # measured batches below this: the figures of how batches came are not given
MIN_READINGS = 10  # readings of the ready batches below this: whether they wait is not given


class LoaderFigures(msgspec.Struct):
    """One rank's training DataLoader (rank 0's, or the lowest that sent any): its settings,
    and what was measured between its sender's first and last reading of each iterator."""

    num_workers: int
    pin_memory: bool  # batches pinned: pin_memory=True with an accelerator to pin for
    persistent_workers: bool
    prefetch_factor: Optional[int]
    batch_size: Optional[int]
    device: str  # where the rank trains: "cpu", "cuda:0"
    usable_cores: int
    iterators_made: int  # training iterators: one an epoch without persistent workers
    batches_measured: int
    batches_per_step: Optional[float]
    worker_cpu_ms_per_batch: Optional[float]  # None without workers, or too few batches
    workers_busy_share: Optional[float]  # their CPU time over their wall time, all workers
    workers_cpu_wait_share: Optional[float]  # of their wall time, ready to run but waiting for a CPU
    ready_share: Optional[float]  # of the readings, those that found a batch made and waiting
    # Iterated ahead of the training on a thread of its own (a prefetcher): that thread's next()
    # time per batch. None: iterated on the training thread.
    thread_ms_per_batch: Optional[float] = None

    @property
    def on_accelerator(self) -> bool:
        return self.device != "cpu"

    def evidence(self) -> Evidence:
        """The figures as a finding's evidence (flat, rounded)."""
        figures: Dict[str, Union[float, int, str, None]] = msgspec.structs.asdict(self)
        return {name: round(value, 4) if isinstance(value, float) else value for name, value in figures.items()}


def loader_figures(samples: Sequence[LoaderSample], window: Window,
                   hellos: Sequence[RankHello]) -> Optional[LoaderFigures]:
    """The figures of the lowest rank that sent any (None: no training DataLoader was seen),
    measured over the window's steps (over the whole run when the window holds too few readings)."""
    if not samples:
        return None
    rank = min(sample.rank for sample in samples)
    by_loader: Dict[int, List[LoaderSample]] = {}
    for sample in samples:
        if sample.rank == rank:
            by_loader.setdefault(sample.loader, []).append(sample)
    latest = max(by_loader.values(), key=lambda mine: mine[-1].batches)[-1]  # the most batches: the training's
    spans = [_within(mine, window) for mine in by_loader.values()]
    batches = sum(last.batches - first.batches for first, last in spans)
    cpu_s = sum(last.worker_cpu_s - first.worker_cpu_s for first, last in spans)
    cpu_wait_s = sum(last.worker_cpu_wait_s - first.worker_cpu_wait_s for first, last in spans)
    thread_s = sum(last.thread_next_s - first.thread_next_s for first, last in spans)
    worker_s = sum((last.unix_s - first.unix_s) * last.num_workers for first, last in spans)
    readings = sum(last.ready_readings - first.ready_readings for first, last in spans)
    with_a_batch = sum(last.ready_readings_with_a_batch - first.ready_readings_with_a_batch for first, last in spans)
    starts = [step.start_unix_s for step in window.steps]
    steps = sum(bisect.bisect_left(starts, last.unix_s) - bisect.bisect_left(starts, first.unix_s)
                for first, last in spans)
    hello = next((h for h in hellos if h.rank == rank), None)
    measured = batches >= MIN_BATCHES
    with_workers = measured and latest.num_workers > 0
    return LoaderFigures(
        num_workers=latest.num_workers, pin_memory=latest.pin_memory,
        persistent_workers=latest.persistent_workers, prefetch_factor=latest.prefetch_factor,
        batch_size=latest.batch_size, device=hello.device if hello is not None else "cpu",
        usable_cores=latest.usable_cores, iterators_made=len(by_loader), batches_measured=batches,
        batches_per_step=batches / steps if measured and steps >= 3 else None,
        worker_cpu_ms_per_batch=cpu_s * 1e3 / batches if with_workers else None,
        workers_busy_share=cpu_s / worker_s if with_workers and worker_s > 0 else None,
        workers_cpu_wait_share=cpu_wait_s / worker_s if with_workers and worker_s > 0 else None,
        ready_share=with_a_batch / readings if with_workers and readings >= MIN_READINGS else None,
        thread_ms_per_batch=thread_s * 1e3 / batches if latest.thread_next_s and batches else None)


def _within(samples: List[LoaderSample], window: Window) -> Tuple[LoaderSample, LoaderSample]:
    """An iterator's first and last reading inside the window's time (all of its readings when
    fewer than two fall inside)."""
    if not len(window):
        return samples[0], samples[-1]
    begin = window.steps[0].start_unix_s
    end = window_end_unix_s(window.steps[-1])
    inside = [sample for sample in samples if begin <= sample.unix_s <= end]
    return (inside[0], inside[-1]) if len(inside) >= 2 else (samples[0], samples[-1])
