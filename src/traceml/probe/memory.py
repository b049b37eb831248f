"""Memory readings for step records: device allocator figures per step, host RSS rate-limited."""
from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from torch import device

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class DeviceMemory:
    """The CUDA caching allocator's counters for one device: host-side reads, never a sync."""

    def __init__(self, torch: ModuleType, device: device, counting: bool = True):
        self._cuda = torch.cuda
        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.capacity_bytes: int = int(torch.cuda.get_device_properties(device).total_memory)
        # torch.cuda.memory_allocated() and friends each flatten the allocator's whole stats
        # dict; one read of the nested dict gives all three figures for a fraction of that.
        self._nested_stats = getattr(torch._C, "_cuda_memoryStats", None)
        self.counting = counting  # False: Trace(profile_memory=False), capacity only

    def reset_peak(self) -> None:
        if self.counting:
            self._cuda.reset_peak_memory_stats(self._device)

    def read(self) -> Tuple[Optional[int], Optional[int], Optional[int]]:
        """(allocated now, peak since the last reset, reserved) in bytes."""
        if not self.counting:
            return None, None, None
        if self._nested_stats is not None:
            stats = self._nested_stats(self._index)
            allocated = stats["allocated_bytes"]["all"]
            return (int(allocated["current"]), int(allocated["peak"]),
                    int(stats["reserved_bytes"]["all"]["current"]))
        cuda, device = self._cuda, self._device
        return (int(cuda.memory_allocated(device)), int(cuda.max_memory_allocated(device)),
                int(cuda.memory_reserved(device)))


class HostRss:
    """Resident set size of this process, read by the sender thread once a round (see
    sender.ROUNDS_PER_FLUSH); each step records the latest reading (steps shorter than a round
    share one)."""

    def __init__(self) -> None:
        self.latest_bytes: Optional[int] = None
        # Opened once: each reading is then a single pread, not open, read and close.
        try:
            self._statm_fd: Optional[int] = os.open(f"/proc/{os.getpid()}/statm", os.O_RDONLY)
        except OSError:
            self._statm_fd = None
        # A first reading now: on a busy machine the sender's first round can come after the
        # first steps have ended, which would then record no RSS at all.
        self.refresh()

    def refresh(self) -> Optional[int]:
        reading = None
        if self._statm_fd is not None:
            try:
                reading = int(os.pread(self._statm_fd, 128, 0).split()[1]) * _PAGE_BYTES
            except (OSError, ValueError, IndexError):
                self._statm_fd = None
        if reading is None:
            with contextlib.suppress(Exception):
                import psutil  # other platforms: slower, still off the hot path

                reading = int(psutil.Process().memory_info().rss)
        self.latest_bytes = reading
        return reading
