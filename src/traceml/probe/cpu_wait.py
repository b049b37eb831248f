"""The training thread's wait for a CPU: its run-queue time, read by the sender thread each round
and spread over the steps that round fell in.

A step that is slow because other processes held the cores looks, on a CPU-computed rank, like
a step that computed more. Linux counts how long each thread was ready to run but waited for a
CPU (/proc/self/task/TID/schedstat, its second figure). Reading it costs one pread, so it is read
off the training thread every sender round (20 ms) and each step gets the wait between its
start and its end, taking the wait as even within a round: a step shorter than a round gets
its share of that round's wait. Where the file is not there (not Linux), steps carry None.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from typing import List, Optional

# Readings kept: 20 s of rounds. A step waits for its window to end (the next step's start),
# and on CUDA for its events, before the sender stamps it; older steps get None.
READINGS_KEPT = 1000


class CpuWait:
    """Run-queue time of one thread (the training's), as (unix time, nanoseconds waited) readings."""

    def __init__(self, native_thread_id: int) -> None:
        try:
            # Opened once (O_CLOEXEC: a DataLoader worker's exec does not inherit it): each
            # reading is then a single pread.
            self._fd: Optional[int] = os.open(f"/proc/self/task/{native_thread_id}/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._times_s: List[float] = []
        self._waited_ns: List[int] = []
        # The sender's thread reads and stamps each round; the training thread does too when the
        # user asks for traceml.summary(): the readings must stay paired and in time order.
        self._lock = threading.Lock()
        self.refresh()  # a first reading before the first step starts

    @property
    def known(self) -> bool:
        return self._fd is not None

    def refresh(self) -> None:
        """Read the wait now (the sender's thread, each round)."""
        with self._lock:
            if self._fd is None:
                return
            try:
                waited_ns = int(os.pread(self._fd, 96, 0).split()[1])
            except (OSError, ValueError, IndexError):
                self._close()
                return
            self._times_s.append(time.time())
            self._waited_ns.append(waited_ns)
            if len(self._times_s) > 2 * READINGS_KEPT:  # trimmed now and then, not on every reading
                del self._times_s[:READINGS_KEPT], self._waited_ns[:READINGS_KEPT]

    def wait_ms(self, start_unix_s: float, end_unix_s: float) -> Optional[float]:
        """The thread's wait for a CPU between two moments, or None where the readings do not
        span them."""
        with self._lock:
            times_s = self._times_s
            if self._fd is None or not times_s or start_unix_s < times_s[0] or end_unix_s > times_s[-1]:
                return None
            return max(0.0, (self._waited_at(end_unix_s) - self._waited_at(start_unix_s)) / 1e6)

    def _waited_at(self, unix_s: float) -> float:
        """The wait so far at a moment within the readings, evenly between two readings."""
        times_s, waited_ns = self._times_s, self._waited_ns
        after = bisect.bisect_left(times_s, unix_s)
        if times_s[after] == unix_s or after == 0:
            return waited_ns[after]
        before = after - 1
        span_s = times_s[after] - times_s[before]
        return waited_ns[before] + (waited_ns[after] - waited_ns[before]) * (unix_s - times_s[before]) / span_s

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
