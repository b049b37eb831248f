"""The node sampler: CPU, RAM and, through NVML when a GPU is present, GPU utilization and memory."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from traceml.records import GpuSample, SystemSample

log = logging.getLogger("traceml")
# Where Linux shows a loaded NVIDIA driver (containers given GPUs mount both).
_NVIDIA_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


class SystemSampler:
    """Samples the node every interval_s on its own thread and hands each sample to `emit`.

    The training processes are the pids given by `training_pids()` plus their children
    (DataLoader workers), so their CPU and RSS are the training's own, not the whole machine's.
    """

    def __init__(self, emit: Callable[[List[SystemSample]], None], training_pids: Callable[[], Iterable[int]],
                 interval_s: float = 1.0):
        import psutil

        self._psutil = psutil
        self._emit = emit
        self._training_pids = training_pids
        self.interval_s = interval_s
        self._processes: Dict[int, Any] = {}
        self._ranks: List[int] = []  # the training ranks alive at the last sample (no children)
        # Each training rank's main thread's wait for a CPU at the last sample, and when.
        self._waited_ns: Dict[int, int] = {}
        self._waited_at_ns = 0
        self._nvml_handles: Optional[List[Any]] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traceml-system", daemon=True)

    def start(self) -> None:
        self._psutil.cpu_percent(None)  # the first reading only starts the interval
        self._nvml_handles = _open_nvml()
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling, with one last sample so a run shorter than interval_s still has one."""
        self._stop.set()
        self._thread.join(timeout=2)
        self._sample_once()
        if self._nvml_handles:
            with contextlib.suppress(Exception):
                import pynvml

                pynvml.nvmlShutdown()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_once()

    def _sample_once(self) -> None:
        try:
            self._emit([self.sample()])
        except Exception:  # a sample less, never the run
            log.debug("traceml: system sample failed", exc_info=True)

    def sample(self) -> SystemSample:
        psutil = self._psutil
        memory = psutil.virtual_memory()
        cpu, rss = self._training_usage()
        return SystemSample(
            unix_s=time.time(), cpu_percent=float(psutil.cpu_percent(None)),
            ram_used_bytes=int(memory.total - memory.available), ram_total_bytes=int(memory.total),
            training_cpu_percent=cpu, training_rss_bytes=rss, gpus=_read_gpus(self._nvml_handles or []),
            cpu_count=psutil.cpu_count() or 0, training_cpu_wait_percent=self._training_cpu_wait())

    def _training_usage(self) -> tuple:
        psutil = self._psutil
        alive: Dict[int, Any] = {}
        ranks: List[int] = []
        for pid in list(self._training_pids()):
            try:
                root = self._processes.get(pid) or psutil.Process(pid)
                alive[pid] = root
                ranks.append(pid)
                for child in root.children(recursive=True):
                    alive[child.pid] = self._processes.get(child.pid) or child
            except psutil.Error:
                continue
        self._processes, self._ranks = alive, ranks
        cpu, rss = 0.0, 0
        for process in alive.values():
            try:
                # The first call on a new Process returns 0.0 and starts its interval.
                cpu += process.cpu_percent(None)
                rss += process.memory_info().rss
            except psutil.Error:
                continue
        return cpu, rss

    def _training_cpu_wait(self) -> Optional[float]:
        """The training ranks' main threads' wait for a CPU since the last sample, in percent of
        one core (None at the first sample, or where Linux's schedstat is not there). A rank seen
        for the first time counts from the next sample."""
        now_ns = time.monotonic_ns()
        waited = {pid: ns for pid, ns in ((pid, _cpu_wait_ns(pid)) for pid in self._ranks) if ns is not None}
        elapsed_ns, self._waited_at_ns = now_ns - self._waited_at_ns, now_ns
        before, self._waited_ns = self._waited_ns, waited
        known = [ns - before[pid] for pid, ns in waited.items() if pid in before and ns >= before[pid]]
        if not known or elapsed_ns <= 0:
            return None
        return round(100.0 * sum(known) / elapsed_ns, 2)


def _cpu_wait_ns(pid: int) -> Optional[int]:
    """How long a process's main thread has waited, ready, for a CPU (/proc/PID/schedstat, its
    second figure), or None where that is not there."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as stream:
            return int(stream.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _open_nvml() -> Optional[List[Any]]:
    if sys.platform.startswith("linux") and not any(os.path.exists(path) for path in _NVIDIA_DRIVER_PATHS):
        return None  # no NVIDIA driver loaded: spare every run on a CPU node NVML's import (~15 ms)
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no driver, no GPU, no library: the GPU fields stay absent
        return None


def _read_gpus(handles: List[Any]) -> List[GpuSample]:
    samples: List[GpuSample] = []
    if not handles:
        return samples
    import pynvml

    for index, handle in enumerate(handles):
        try:
            utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception:
            continue
        temperature = power = None
        with contextlib.suppress(Exception):
            temperature = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
            power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        samples.append(GpuSample(index=index, utilization_percent=float(utilization.gpu),
                                 memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total),
                                 temperature_c=temperature, power_w=power))
    return samples
