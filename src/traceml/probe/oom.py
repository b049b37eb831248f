"""A step that runs out of memory: the OomRecord saying where it was and how full memory was."""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Tuple

from traceml.probe.step_state import FAILED_PHASE, NO_PHASE
from traceml.records import TIMED_PHASES, OomRecord, Phase


class OomProbe(Protocol):
    """What the OOM report reads of the step probe (a probe.step.StepProbe) as the error leaves."""

    rank: int
    step_index: int
    sums: list  # the step in flight's list: the phase an exception left through (FAILED_PHASE)
    open_phase: int
    layers: Any  # the LayerProbe under deep-dive, or None
    device_memory: Any  # probe.memory.DeviceMemory on CUDA, or None
    host_rss: Any  # probe.memory.HostRss, or None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether the error leaving a step is the host's or the device's memory running out."""
    if isinstance(error, MemoryError):
        return True
    name = type(error).__name__
    return name == "OutOfMemoryError" or (isinstance(error, RuntimeError)
                                         and "out of memory" in str(error).lower())


def oom_record(probe: OomProbe, error: BaseException) -> OomRecord:
    """Out of memory: where the step was and how full memory was (the error then goes on)."""
    phase = probe.sums[FAILED_PHASE] if probe.sums[FAILED_PHASE] != NO_PHASE else probe.open_phase
    layers = probe.layers
    layer = _layer_in_flight(error, layers)
    largest: List[Tuple[str, int]] = []
    if layers is not None:
        sizes = [(name, int(stats[3])) for name, stats in layers.stats.items() if name in layers.leaves and stats[3]]
        largest = sorted(sizes, key=lambda item: -item[1])[:5]
    allocated = peak = reserved = None
    if probe.device_memory is not None:
        allocated, peak, reserved = probe.device_memory.read()
    return OomRecord(
        rank=probe.rank, step=probe.step_index,
        phase=TIMED_PHASES[phase] if phase != NO_PHASE else Phase.UNTRACED, layer=layer,
        message=str(error).strip().splitlines()[0][:500] if str(error).strip() else type(error).__name__,
        allocated_bytes=allocated, reserved_bytes=reserved, peak_bytes=peak,
        host_rss_bytes=probe.host_rss.latest_bytes if probe.host_rss is not None else None,
        largest_layers=largest)


def _layer_in_flight(error: BaseException, layers: Any) -> Optional[str]:
    """The innermost traced module whose forward the error passed through, from its traceback
    (free: no hook is needed on the steps that are not sampled)."""
    if layers is None:
        return None
    found = layers.current_layer()
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        name = layers.names.get(id(module)) if module is not None else None
        if name is not None:
            found = name
        tb = tb.tb_next
    return found
