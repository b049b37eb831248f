"""Memory rules: MEMORY_CREEP (a trend that ends in OOM), MEMORY_PRESSURE (near capacity), and
the post-mortem of an out-of-memory error."""
from __future__ import annotations

import random
import statistics
from typing import Iterable, List, Optional, Tuple

import msgspec

from traceml.analysis.layer_rows import AliveLayer
from traceml.analysis.ledger import PART_WORDS, LedgerRow, part_bytes
from traceml.analysis.rollup import Window
from traceml.records import Evidence, Finding, FindingKind, OomRecord, RankHello, Severity, SystemSample
from traceml.words import counted

MIN_POINTS = 20  # steps of memory readings before a trend can be called
MIN_READINGS = 9  # distinct readings among them: three to each third of the window
MIN_GROWTH_BYTES = 4 * 2 ** 20  # what the trend must add over the window, at least...
MIN_GROWTH_SHARE = 0.02  # ... and as a share of the memory held
MIN_CONCORDANCE = 0.75  # share of (earlier, later) pairs where the later holds more
PERSIST_SHARE = 0.3  # each third of the window must grow by this share of the trend
CRIT_GROWTH_SHARE = 0.10  # a trend adding this share of what is held over the window: crit
OOM_SOON_WINDOWS = 10  # ... or one that runs out within this many windows' worth of steps
PRESSURE_WARN = 0.90  # peak at this share of capacity: warn
PRESSURE_CRIT = 0.97

LEAK_CAUSES = ("Something keeps every step's tensors alive. The usual causes: accumulating the "
               "loss tensor (`total += loss`; use `loss.item()` or `loss.detach()`), keeping "
               "outputs or activations in a list, `backward(retain_graph=True)`, or a cache "
               "that grows with every batch.")


# What to do about the part of memory that dominates (MEMORY_PRESSURE) or grows (MEMORY_CREEP).
PART_ADVICE = {
    "parameters_frozen": ("Store the frozen weights smaller: load the base in bf16, or quantized (4-bit or 8-bit, "
                          "QLoRA), or shard them across ranks (FSDP)."),
    "parameters_trainable": ("Train fewer weights (an adapter such as LoRA), keep them in bf16, or shard them "
                             "across ranks (FSDP, ZeRO-3)."),
    "gradients": ("Gradients follow the trainable weights: train fewer (LoRA), in bf16, or shard the gradients "
                  "across ranks (ZeRO-2, FSDP)."),
    "optimizer_state": ("Keep less optimizer state: a fused or 8-bit optimizer (bitsandbytes' AdamW8bit), "
                        "one with less state (Adafactor, SGD), or shard it across ranks (ZeRO-1/2, FSDP)."),
    "activations": ("Keep fewer activations for backward: activation checkpointing on the blocks, or a smaller "
                    "micro-batch with more gradient accumulation steps."),
    "cache": ("The allocator holds memory it cannot reuse (fragmentation): set "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."),
    "rest": LEAK_CAUSES,
}
GROWTH_EXPLAINED = 0.5  # a counted part that adds this share of the trend's growth is what grows


def largest_part(ledger: Optional[List[LedgerRow]]) -> Optional[Tuple[str, int, float, LedgerRow]]:
    """(part, bytes, its share of what the rank held, the row): the part that holds the most
    of the rank whose memory is fullest."""
    rows = [row for row in ledger or () if row.get("held")]
    if not rows:
        return None
    row = max(rows, key=lambda r: r["held"] or 0)
    parts = part_bytes(row)
    part = max(parts, key=lambda name: parts[name])
    held = row["held"]
    return part, parts[part], parts[part] / held if held else 0.0, row


def growing_part(ledger: Optional[List[LedgerRow]], growth_bytes: float) -> str:
    """The ledger's part that adds most of a memory trend's growth ("rest" when none of the
    counted parts does: tensors the ledger does not count are kept from step to step)."""
    best, best_bytes = "rest", 0
    for row in ledger or ():
        for part, added in row["growth"].items():
            if added > best_bytes:
                best, best_bytes = part, added
    return best if best_bytes >= GROWTH_EXPLAINED * growth_bytes else "rest"


class MemoryLimits(msgspec.Struct):
    """What memory there is: the device's capacity, the host's RAM."""

    device_capacity_bytes: Optional[int] = None
    host_total_bytes: Optional[int] = None
    host_available_bytes: Optional[int] = None  # free RAM at the last system sample

    @classmethod
    def of_run(cls, hellos: Iterable[RankHello], last_sample: Optional[SystemSample]) -> "MemoryLimits":
        """The largest device a rank announced; the host's RAM as last sampled."""
        capacities = [h.device_capacity_bytes for h in hellos if h.device_capacity_bytes]
        return cls(device_capacity_bytes=max(capacities) if capacities else None,
                   host_total_bytes=last_sample.ram_total_bytes if last_sample else None,
                   host_available_bytes=(last_sample.ram_total_bytes - last_sample.ram_used_bytes
                                         if last_sample else None))


def _gib(value: float) -> str:
    return f"{value / 2 ** 30:.2f} GiB" if abs(value) >= 2 ** 30 else f"{value / 2 ** 20:.1f} MiB"


def memory_creep(window: Window, limits: MemoryLimits, layers_alive: Optional[List[AliveLayer]] = None,
                 ledger: Optional[List[LedgerRow]] = None) -> Optional[Finding]:
    trend = window.memory_trend
    if trend.window_steps < MIN_POINTS:
        return None
    # A trend needs enough distinct readings, or an allocator's few warm-up step-ups look
    # like one.
    readings = sum(1 for before, after in zip(trend.held_bytes, trend.held_bytes[1:]) if after != before) + 1
    if readings < MIN_READINGS:
        return None
    steps, held, slope = trend.steps, trend.held_bytes, trend.bytes_per_step
    device = trend.measured_on == "device_allocated"
    growth = slope * (steps[-1] - steps[0])
    if slope <= 0 or growth < max(MIN_GROWTH_BYTES, MIN_GROWTH_SHARE * held[-1]):
        return None
    if _concordance(held) < MIN_CONCORDANCE or not _persists(steps, held, slope):
        return None
    where = "device memory allocated" if device else "host RSS"
    if device:
        headroom = (limits.device_capacity_bytes or 0) - held[-1]
    else:
        headroom = limits.host_available_bytes or 0
    oom_step = steps[-1] + int(headroom / slope) if headroom > 0 else None
    part = growing_part(ledger, growth) if ledger else None
    driven = f", {PART_WORDS[part]} growing" if part is not None else ""
    forecast = (f"at this rate it runs out near step {oom_step:,} ({_gib(headroom)} left{driven})"
                if oom_step is not None else "the memory limit is not known")
    evidence: Evidence = {"bytes_per_step": round(slope, 1), "held_bytes": held[-1], "growth_bytes": round(growth),
                "measured_on": trend.measured_on, "steps": trend.window_steps, "over_steps": steps[-1] - steps[0],
                "projected_oom_step": oom_step, "phase": "held across steps", "headroom_bytes": headroom if headroom > 0 else None,
                "share": round(min(1.0, growth / held[-1]), 4) if held[-1] else None}
    summary = (f"{where} at step end grows {_gib(slope)} a step ({_gib(growth)} over "
               f"{counted(steps[-1] - steps[0], 'step')}): it outlives backward and the optimizer step, "
               f"held from one step to the next; {forecast}")
    if part == "rest":
        summary += ("; the ledger's parts (parameters, gradients, optimizer state, activations) stay flat: "
                    "the growth is tensors outside them, kept from step to step")
    elif part is not None:
        summary += f"; of the ledger's parts, {PART_WORDS[part]} grows"
    if part is not None:
        evidence["growing_part"] = part
    if layers_alive:
        top = ", ".join(f"{layer['name']} ({_gib(layer['alive_bytes'])})" for layer in layers_alive[:3])
        summary += f"; layers whose outputs or saved tensors outlive the step: {top}"
        evidence["layers_alive"] = top
    # It will run out: soon, or it adds so much of what is held that it is no allocator's
    # settling (a busy machine's RSS drifts by a few percent; a kept graph doubles it).
    soon = oom_step is not None and oom_step - steps[-1] <= OOM_SOON_WINDOWS * (steps[-1] - steps[0])
    fast = oom_step is not None and held[-1] and growth >= CRIT_GROWTH_SHARE * held[-1]
    return Finding(kind=FindingKind.MEMORY_CREEP, severity=Severity.CRIT if soon or fast else Severity.WARN,
                   summary=summary, action=PART_ADVICE.get(part or "rest", LEAK_CAUSES), evidence=evidence)


def _persists(steps: List[int], held: List[int], slope: float) -> bool:
    """A leak grows all along; an allocator warming up steps up once and stays flat. Each
    third of the window must add at least a third of what the slope says it should."""
    third = len(held) // 3
    for part in range(3):
        lo, hi = part * third, (part + 1) * third if part < 2 else len(held)
        head, tail = held[lo:lo + 3], held[hi - 3:hi]
        added = statistics.median(tail) - statistics.median(head)
        if added < PERSIST_SHARE * slope * (steps[hi - 1] - steps[lo]):
            return False
    return True


def _concordance(values: List[int], pairs: int = 2000) -> float:
    """Share of (earlier, later) pairs where the later value is larger; ties count half."""
    rng = random.Random(0)
    n = len(values)
    above = 0.0
    for _ in range(pairs):
        i, j = sorted(rng.sample(range(n), 2))
        above += 1.0 if values[j] > values[i] else 0.5 if values[j] == values[i] else 0.0
    return above / pairs


def memory_pressure(window: Window, limits: MemoryLimits, peak_device_bytes: Optional[int],
                    peak_rss_bytes: Optional[int], ledger: Optional[List[LedgerRow]] = None) -> Optional[Finding]:
    if peak_device_bytes is not None and limits.device_capacity_bytes:
        peak, capacity, what = peak_device_bytes, limits.device_capacity_bytes, "device memory"
    elif peak_rss_bytes is not None and limits.host_total_bytes:
        peak, capacity, what = peak_rss_bytes, limits.host_total_bytes, "host RAM"
    else:
        return None
    ratio = peak / capacity
    if ratio < PRESSURE_WARN:
        return None
    summary = (f"{what} peaks at {ratio:.0%} of capacity: {_gib(peak)} of {_gib(capacity)}, "
               f"{_gib(capacity - peak)} of headroom")
    action = ("One larger batch or sequence will not fit. Cut activation memory: activation "
              "checkpointing, mixed precision (bf16), a smaller micro-batch with gradient "
              "accumulation, or an optimizer that keeps less state.")
    evidence: Evidence = {"peak_bytes": peak, "capacity_bytes": capacity, "share": round(ratio, 4),
                          "headroom_bytes": capacity - peak}
    largest = largest_part(ledger)
    if largest is not None:
        part, size, share, row = largest
        summary += (f"; the largest part is {PART_WORDS[part]}: {_gib(size)}, {share:.0%} of the {_gib(row['held'] or 0)} "
                    f"rank {row['rank']} holds")
        action = "One larger batch or sequence will not fit. " + PART_ADVICE[part]
        evidence.update(largest_part=part, largest_part_bytes=size, largest_part_rank=row["rank"],
                        largest_part_rank_held_bytes=row["held"])
    return Finding(kind=FindingKind.MEMORY_PRESSURE,
                   severity=Severity.CRIT if ratio >= PRESSURE_CRIT else Severity.WARN,
                   summary=summary, action=action, evidence=evidence)


def out_of_memory(oom: OomRecord, limits: MemoryLimits) -> Finding:
    """The post-mortem of a step that ran out of memory: where, how full, which layers."""
    where = f"in {oom.phase}" + (f", inside layer {oom.layer}" if oom.layer else "")
    held = oom.allocated_bytes if oom.allocated_bytes is not None else oom.host_rss_bytes
    capacity = limits.device_capacity_bytes if oom.allocated_bytes is not None else limits.host_total_bytes
    fill = f"; {_gib(held)} allocated" if held is not None else ""
    if held is not None and capacity:
        fill += f" of {_gib(capacity)}"
    if oom.peak_bytes is not None:
        fill += f", peak {_gib(oom.peak_bytes)}"
    if oom.reserved_bytes is not None:
        fill += f", reserved {_gib(oom.reserved_bytes)}"
    largest = ", ".join(f"{name} ({_gib(size)})" for name, size in oom.largest_layers[:3])
    summary = f"out of memory at step {oom.step} on rank {oom.rank} {where}{fill}"
    if largest:
        summary += f"; largest layers by saved activations: {largest}"
    return Finding(
        kind=FindingKind.MEMORY_PRESSURE, severity=Severity.CRIT, summary=summary, rank=oom.rank,
        action=("Lower the memory of that phase: a smaller micro-batch with gradient "
                "accumulation, activation checkpointing on the largest layers, mixed precision; "
                "if reserved is far above allocated, fragmentation: set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."),
        evidence={"oom": True, "step": oom.step, "rank": oom.rank, "phase": oom.phase, "layer": oom.layer,
                  "held_bytes": held, "capacity_bytes": capacity, "largest_layers": largest or None,
                  "allocated_bytes": oom.allocated_bytes, "reserved_bytes": oom.reserved_bytes,
                  "peak_bytes": oom.peak_bytes, "message": oom.message[:200], "share": 1.0})
