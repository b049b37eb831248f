"""The training's DataLoader iterators as the sender thread sees them work: what they are set to
do, the batches they hand over, their worker processes' CPU time, and whether a batch is already
made and waiting when the training asks for the next one.

An iterator is noted once: when it is made (the patched _BaseDataLoaderIter.__init__), or, for
the one a loop was already in when TraceML attached (a `for` loop makes its iterator before the
first step), at its first batch after that. An evaluation's iterator (made with gradients off, or
inside a trainer's evaluation) is not noted. A thread that iterates one ahead of the training (a
prefetcher) adds up the time its next() calls take (made_on_thread). Everything else happens on
the sender thread, from the iterator's own attributes and the workers' /proc entries: TraceML
never calls the user's Dataset, sampler or collate function, and holds the iterator only by a
weak reference, so its workers end when the user's loop lets it go.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from traceml.records import LoaderSample

if TYPE_CHECKING:
    # A DataLoader's iterator: its private attributes are what the watch reads.
    from torch.utils.data.dataloader import _BaseDataLoaderIter as LoaderIterator

log = logging.getLogger("traceml")

SAMPLE_EVERY_S = 0.5  # each iterator's figures go out this often while it hands batches over


def usable_cores() -> int:
    """CPUs this process may run on: its affinity where the system has one, else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Watched:
    """One noted iterator: what has been read of it so far."""

    def __init__(self, iterator: LoaderIterator, index: int):
        self.ref = weakref.ref(iterator, self._gone)
        self.index = index
        self.config: Optional[dict] = None  # read at its first batch: its __init__ is done by then
        self.ready_count: Optional[Callable[[], int]] = None  # batches made and waiting
        self.worker_pids: List[int] = []
        self.times_by_worker: dict = {}  # pid -> the latest (CPU time, time waiting for a CPU) read
        self.batches = self.last_yielded = 0
        self.thread_next_ns = 0  # its next() calls' time on a thread other than the training's
        self.readings = self.readings_with_a_batch = 0
        self.sent_at = 0.0

    def _gone(self, ref: weakref.ref[LoaderIterator]) -> None:
        """The user's loop let the iterator go: let its queue and workers go too, at once."""
        self.ready_count = None
        self.worker_pids = []


class LoaderWatch:
    """The rank's training iterators: noted by the training thread, read by the sender's."""

    def __init__(self, rank: int):
        self.rank = rank
        self.cores = usable_cores()
        self._watched: List[_Watched] = []
        self._made = 0
        self._lock = threading.Lock()  # note() appends on the training thread, the sender prunes

    # -- training thread: once per iterator ---------------------------------------------------
    def note(self, iterator: LoaderIterator) -> None:
        with self._lock:
            if any(watched.ref() is iterator for watched in self._watched):
                return
            self._watched.append(_Watched(iterator, self._made))
            self._made += 1

    # -- a thread that iterates one for the training (a prefetcher): per batch -----------------
    def made_on_thread(self, iterator: LoaderIterator, elapsed_ns: int) -> None:
        for watched in self._watched:  # the live ones: one or two
            if watched.ref() is iterator:
                watched.thread_next_ns += elapsed_ns

    # -- sender thread ------------------------------------------------------------------------
    def read_ready(self) -> None:
        """Each round (every 20 ms): is a batch waiting for the training to take it?"""
        for watched in list(self._watched):
            ready_count = watched.ready_count
            if ready_count is None:
                continue
            try:
                waiting = ready_count()
            except Exception:  # a queue that cannot say (qsize on macOS): no readings
                watched.ready_count = None
                continue
            watched.readings += 1
            if waiting > 0:
                watched.readings_with_a_batch += 1

    def samples(self, final: bool = False) -> List[LoaderSample]:
        """The figures of each iterator that handed batches over since it was last sent, every
        SAMPLE_EVERY_S (final: now, at the run's end); iterators that are gone are forgotten."""
        now_s = time.time()
        out = []
        with self._lock:
            self._watched = [watched for watched in self._watched if watched.ref() is not None]
            watching = list(self._watched)
        for watched in watching:
            if (now_s - watched.sent_at < SAMPLE_EVERY_S and not final) or not self._read(watched):
                continue
            watched.sent_at = now_s
            out.append(LoaderSample(  # type: ignore[arg-type]  # None only for a loader not read
                rank=self.rank, loader=watched.index, unix_s=now_s, **watched.config,
                usable_cores=self.cores, batches=watched.batches,
                worker_cpu_s=sum(cpu_s for cpu_s, _ in watched.times_by_worker.values()),
                ready_readings=watched.readings, ready_readings_with_a_batch=watched.readings_with_a_batch,
                thread_next_s=watched.thread_next_ns / 1e9,
                worker_cpu_wait_s=sum(wait_s for _, wait_s in watched.times_by_worker.values())))
        return out

    def awaited_worker(self) -> Optional[Tuple[int, int, str]]:
        """While the training thread waits for a batch (a stall's pulse asks): the worker that
        owes it, as (worker id, pid, state: "sleeping", "running", "disk wait", "gone", ...);
        None when no noted iterator with workers is owed one."""
        with self._lock:
            watching = [watched.ref() for watched in self._watched]
        for iterator in reversed(watching):  # the newest iterator first: the one a loop is in
            if iterator is None or not getattr(iterator, "_num_workers", 0):
                continue
            # The batch the iterator hands over next, and the worker it was sent to: its task
            # holds (worker id,) until the batch comes back.
            task = getattr(iterator, "_task_info", {}).get(getattr(iterator, "_rcvd_idx", -1))
            if not task or len(task) != 1:
                continue
            worker_id = int(task[0])
            workers = getattr(iterator, "_workers", ())
            pid = workers[worker_id].pid if worker_id < len(workers) else 0
            return worker_id, pid or 0, process_state(pid) if pid else ""
        return None

    def _read(self, watched: _Watched) -> bool:
        """Read the iterator's batch count (and, once, its configuration and workers); False
        when it has not handed a batch over since the last reading (or is gone)."""
        iterator = watched.ref()
        if iterator is None:
            return False
        yielded = iterator._num_yielded  # back to 0 at each epoch of a persistent iterator
        if watched.config is None and yielded:
            self._first_read(watched, iterator)
        del iterator  # the user's to free: never held past this reading
        added = yielded - watched.last_yielded if yielded >= watched.last_yielded else yielded
        watched.last_yielded = yielded
        if watched.config is None or not added:
            return False
        times_by_worker = {}
        for pid in watched.worker_pids:
            times = worker_times(pid)
            if times is None:  # ended (the epoch is over): the figures sent last stand
                return False
            times_by_worker[pid] = times
        watched.batches += added
        watched.times_by_worker = times_by_worker
        return True

    def _first_read(self, watched: _Watched, iterator: LoaderIterator) -> None:
        num_workers = int(iterator._num_workers)
        sampler = getattr(iterator, "_index_sampler", None)
        batch_size = getattr(sampler, "batch_size", None) if getattr(iterator, "_auto_collation", False) else None
        watched.config = {
            "num_workers": num_workers, "pin_memory": bool(iterator._pin_memory),
            "persistent_workers": bool(iterator._persistent_workers),
            "prefetch_factor": getattr(iterator, "_prefetch_factor", None) if num_workers else None,
            "batch_size": batch_size if isinstance(batch_size, int) else None}
        if not num_workers:
            return
        queue = getattr(iterator, "_data_queue", None)
        if queue is not None:
            watched.ready_count = queue.qsize
        watched.worker_pids = [process.pid for process in getattr(iterator, "_workers", ())]


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def worker_times(pid: int) -> Optional[Tuple[float, float]]:
    """A worker process's CPU time (user + system, all its threads) and the time its main
    thread (where the Dataset runs) waited for a CPU while it could have run, in seconds; None
    once it has ended. From /proc on Linux, checking that it is still this process's child (a
    pid is reused); elsewhere the CPU time from psutil, and no waiting known."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: another system
        cpu_s = _psutil_cpu_s(pid)
        return None if cpu_s is None else (cpu_s, 0.0)
    if int(fields[1]) != os.getpid():
        return None
    try:  # on a run queue, not running: the kernel's schedstat (ns)
        with open(f"/proc/{pid}/schedstat", "rb") as schedstat:
            wait_s = int(schedstat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        wait_s = 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S, wait_s


# /proc/PID/stat's state letters, as a stall's finding words them.
_STATES = {"R": "running", "S": "sleeping", "D": "disk wait", "Z": "gone", "X": "gone", "T": "stopped",
           "t": "stopped"}


def process_state(pid: int) -> str:
    """A process's state as the kernel gives it ("sleeping", "running", "disk wait", "gone"); ""
    where it cannot be read."""
    try:
        return _STATES.get(_stat_fields(pid)[0].decode(), "")
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return ""


def _stat_fields(pid: int) -> List[bytes]:
    """/proc/PID/stat's fields after the command name: state, parent pid, ... (OSError without it)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()


def _psutil_cpu_s(pid: int) -> Optional[float]:
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except Exception:
        return None
