"""The training thread's time on a CPU and its wait for one: Linux's counts for the thread, read
by the sender thread each round and spread over the steps that round fell in.

A step that is slow because other processes held the cores looks, on a CPU-computed rank, like
a step that computed more. Linux counts how long each thread ran on a CPU and how long it was
ready to run but waited for one (/proc/self/task/TID/schedstat, its first two figures): what a
rank did against what the machine kept it from doing. The time on a CPU is read from the
thread's CPU clock first: schedstat's own figure moves only at the kernel's tick (4 ms here)
while the thread runs, and reading the clock brings it up to date. Each costs a system call, so
both are read off the training thread every sender round (20 ms), and each step gets the time
between its start and its end, taking both as even within a round: a step shorter than a round
gets its share of that round's. Linux adds a wait to the count when the thread gets its CPU
back, so a round can hold more wait than its own length (a wait that began in the round
before): a step's time on a CPU and its wait together are capped at its length. Where the file
is not there (not Linux), steps carry None.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from typing import List, Optional, Tuple

# Readings kept: 16 s of rounds or more (on CUDA a round in five reads twice). A step waits for
# its window to end (the next step's start), and on CUDA for its events, before the sender stamps
# it; older steps get None.
READINGS_KEPT = 1000


class ThreadCpu:
    """One thread's (the training's) time on a CPU and wait for one, as readings of (unix time,
    nanoseconds run, nanoseconds waited)."""

    def __init__(self, native_thread_id: int, cpu_clock_id: Optional[int] = None) -> None:
        """cpu_clock_id: the thread's CPU clock (time.pthread_getcpuclockid); None: schedstat's
        own figure, to the kernel's tick."""
        self._cpu_clock_id = cpu_clock_id
        try:
            # Opened once (O_CLOEXEC: a DataLoader worker's exec does not inherit it): each
            # reading is then a single pread.
            self._fd: Optional[int] = os.open(f"/proc/self/task/{native_thread_id}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._times_s: List[float] = []
        self._ran_ns: List[int] = []
        self._waited_ns: List[int] = []
        # The sender's thread reads and stamps each round; the training thread does too when the
        # user asks for traceml.summary(): the readings must stay together and in time order.
        self._lock = threading.Lock()
        self.refresh()  # a first reading before the first step starts

    @classmethod
    def of_this_thread(cls) -> "ThreadCpu":
        """The calling thread's counts (made on the training thread)."""
        try:
            cpu_clock_id: Optional[int] = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):  # no per-thread CPU clocks here
            cpu_clock_id = None
        return cls(threading.get_native_id(), cpu_clock_id)

    @property
    def known(self) -> bool:
        return self._fd is not None

    def refresh(self) -> None:
        """Read the counts now (the sender's thread, each round)."""
        with self._lock:
            if self._fd is None:
                return
            before_s = time.time()
            try:
                clock_ns = None if self._cpu_clock_id is None else time.clock_gettime_ns(self._cpu_clock_id)
                ran_ns, waited_ns = map(int, os.pread(self._fd, 96, 0).split()[:2])
            except (OSError, ValueError):  # the thread is gone
                self._close()
                return
            ran_ns = clock_ns if clock_ns is not None else ran_ns
            # The middle of the read: on a busy machine this thread can itself wait around it.
            self._times_s.append((before_s + time.time()) / 2)
            self._ran_ns.append(ran_ns)
            self._waited_ns.append(waited_ns)
            if len(self._times_s) > 2 * READINGS_KEPT:  # trimmed now and then, not on every reading
                for readings in (self._times_s, self._ran_ns, self._waited_ns):
                    del readings[:READINGS_KEPT]

    def ran_and_waited_ms(self, start_unix_s: float, end_unix_s: float) -> Optional[Tuple[float, float]]:
        """The thread's time on a CPU and its wait for one between two moments, or None where
        the readings do not span them."""
        with self._lock:
            times_s = self._times_s
            if self._fd is None or not times_s or start_unix_s < times_s[0] or end_unix_s > times_s[-1]:
                return None
            length_ms = (end_unix_s - start_unix_s) * 1e3
            ran_start, waited_start = self._counts_at(start_unix_s)
            ran_end, waited_end = self._counts_at(end_unix_s)
            ran_ms = min(max(0.0, (ran_end - ran_start) / 1e6), length_ms)
            return ran_ms, min(max(0.0, (waited_end - waited_start) / 1e6), length_ms - ran_ms)

    def _counts_at(self, unix_s: float) -> Tuple[float, float]:
        """Both counts at a moment within the readings, evenly between two readings."""
        times_s, ran_ns, waited_ns = self._times_s, self._ran_ns, self._waited_ns
        after = bisect.bisect_left(times_s, unix_s)
        if times_s[after] == unix_s or after == 0:
            return ran_ns[after], waited_ns[after]
        before = after - 1
        share = (unix_s - times_s[before]) / (times_s[after] - times_s[before])
        return (ran_ns[before] + (ran_ns[after] - ran_ns[before]) * share,
                waited_ns[before] + (waited_ns[after] - waited_ns[before]) * share)

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
