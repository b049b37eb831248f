"""The memory ledger, per rank: what holds the memory (parameters trainable and frozen, adapters,
gradients, optimizer state, activations, the rest), from the probes' MemoryLedger readings and
the step records' memory figures. The summary, the card, the web page, /metrics and the memory
rules all read these rows.

The rest is what memory holds beyond the parts the probe counts: on a device, the peak
allocated in a step minus the parts (the peak is when activations are alive), and, apart from it,
the allocator's cache: reserved minus allocated at that step; on the CPU, the host RSS minus the
parts (the interpreter, torch's own libraries, the DataLoader's buffers are in it).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, TypedDict, Union

from traceml.analysis.layer_rows import LayerRow
from traceml.records import MemoryLedger, StepRecord, adapter_target

# The parts a rank's memory is split into, in the order a stacked bar draws them (also the
# `part` label of traceml_memory_ledger_bytes).
LEDGER_PARTS = ("parameters_frozen", "parameters_trainable", "gradients", "optimizer_state", "activations",
                "rest", "cache")
PART_WORDS = {"parameters_frozen": "frozen parameters", "parameters_trainable": "trainable parameters",
              "parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
              "activations": "activations", "rest": "the rest", "cache": "the allocator's cache"}


class LedgerParameters(TypedDict):
    trainable: int
    frozen: int
    trainable_dtypes: Dict[str, int]  # dtype name -> bytes
    frozen_dtypes: Dict[str, int]
    count: int
    trainable_count: int
    unsharded: Optional[int]  # a sharded model's parameters whole (None: not sharded)


class Adapters(TypedDict):
    """A parameter-efficient fine-tune's adapters (LoRA), as the ledger counts them."""

    kind: str
    r: Optional[int]
    count: int
    parameters: int  # bytes
    gradients: int
    optimizer_state: int
    targets: Dict[str, int]  # adapted module name -> bytes
    share_of_parameters: Optional[float]
    share_of_parameter_bytes: Optional[float]
    forward_share: Optional[float]  # of their layers' time, under deep-dive
    backward_share: Optional[float]


class Sharding(TypedDict):
    """A sharded model's figures beside the local shard's (bytes; None: not measured)."""

    parameters_unsharded: Optional[int]
    gradients_unsharded: Optional[int]
    optimizer_state_unsharded: Optional[int]
    gathered_peak_forward: Optional[int]
    gathered_peak_backward: Optional[int]
    mesh_coordinate: Dict[str, int]


class LedgerRow(TypedDict):
    """One rank's memory ledger, from its latest reading (the summary's memory.ledger)."""

    rank: int
    step: int
    parameters: LedgerParameters
    adapters: Optional[Adapters]
    gradients: int
    optimizer_state: int
    optimizers: Dict[str, int]  # optimizer class -> its state's bytes
    activations: Optional[int]
    activations_step: Optional[int]
    measured_on: Optional[str]  # "device_peak" or "host_rss"; None: no step record to say
    held: Optional[int]
    rest: Optional[int]
    cache: Optional[int]
    growth: Dict[str, int]  # part -> bytes added over the measured steps
    sharding: Optional[Sharding]
    sharded_by: Optional[str]


class DeviceMesh(TypedDict):
    dims: Dict[str, int]  # name -> size, outer first
    coordinates: Dict[Union[int, str], Dict[str, int]]  # rank -> name -> index (read from JSON: the rank as text)


class _Held(TypedDict, total=False):
    measured_on: str
    held: int
    cache: Optional[int]


def ledger_rows(ledgers: Sequence[MemoryLedger], records: Iterable[StepRecord],
                layers: Sequence[LayerRow] = (), first_step: Optional[int] = None) -> List[LedgerRow]:
    """One row per rank that sent a reading, from its latest: see the module's docstring.
    records: the step records (any sample of them), for what the rank's memory held; layers:
    the deep-dive's rows (report.deep_dive.layer_rows), for the adapters' share of the time;
    first_step: where the measured steps start, for each part's growth since."""
    by_rank: Dict[int, List[MemoryLedger]] = {}
    for ledger in ledgers:
        by_rank.setdefault(ledger.rank, []).append(ledger)
    held = _held_by_rank(records)
    adapter_time = adapter_time_shares(layers)
    return [_row(readings, held.get(rank), adapter_time, first_step) for rank, readings in sorted(by_rank.items())]


def _row(readings: List[MemoryLedger], held: Optional[_Held], adapter_time: Dict[str, Optional[float]],
         first_step: Optional[int]) -> LedgerRow:
    latest = readings[-1]
    parts = _parts(latest)
    counted = sum(parts.values())
    row: LedgerRow = {
        "rank": latest.rank, "step": latest.step,
        "parameters": {"trainable": latest.trainable_bytes, "frozen": latest.frozen_bytes,
                       "trainable_dtypes": dict(latest.trainable_dtypes), "frozen_dtypes": dict(latest.frozen_dtypes),
                       "count": latest.parameters, "trainable_count": latest.trainable_parameters,
                       "unsharded": latest.unsharded_parameter_bytes},
        "adapters": _adapters(latest, adapter_time),
        "gradients": latest.gradient_bytes,
        "optimizer_state": sum(latest.optimizer_state_bytes.values()),
        "optimizers": dict(latest.optimizer_state_bytes),
        "activations": latest.activation_bytes, "activations_step": latest.activation_step,
        "measured_on": None, "held": None, "rest": None, "cache": None,
        "growth": _growth(readings, first_step),
        "sharding": _sharding(latest),
        "sharded_by": latest.sharded_by or None,  # "FSDP2", "DeepSpeed ZeRO-2"; None: not sharded
    }
    if held is not None:
        row["measured_on"], row["held"] = held["measured_on"], held["held"]
        row["rest"] = max(0, held["held"] - counted)
        row["cache"] = held.get("cache")
    return row


def _sharding(ledger: MemoryLedger) -> Optional[Sharding]:
    """A sharded model's figures beside the local shard's: what parameters, gradients and
    optimizer state would take unsharded, and the most held all-gathered at once (None: not
    sharded)."""
    if ledger.unsharded_parameter_bytes is None:
        return None
    return {"parameters_unsharded": ledger.unsharded_parameter_bytes,
            "gradients_unsharded": ledger.unsharded_gradient_bytes,
            "optimizer_state_unsharded": ledger.unsharded_optimizer_bytes,
            "gathered_peak_forward": ledger.gathered_forward_peak_bytes,
            "gathered_peak_backward": ledger.gathered_backward_peak_bytes,
            "mesh_coordinate": dict(ledger.mesh_coordinate)}


def device_mesh(rows: Sequence[LedgerRow], ledgers: Sequence[MemoryLedger]) -> Optional[DeviceMesh]:
    """The sharded parameters' DeviceMesh: {"dims": name -> size, "coordinates": rank -> (name
    -> index)} from the ranks' ledger readings (None: no rank read one)."""
    dims = next((dict(ledger.mesh_dims) for ledger in reversed(ledgers) if ledger.mesh_dims), None)
    if dims is None:
        return None
    coordinates: Dict[Union[int, str], Dict[str, int]] = {
        row["rank"]: sharding["mesh_coordinate"] for row in rows
        for sharding in [row["sharding"]] if sharding and sharding["mesh_coordinate"]}
    return {"dims": dims, "coordinates": coordinates}


def _parts(ledger: MemoryLedger) -> Dict[str, int]:
    """The counted parts of a reading, in bytes (activations 0 before a sampled step)."""
    return {"parameters_frozen": ledger.frozen_bytes, "parameters_trainable": ledger.trainable_bytes,
            "gradients": ledger.gradient_bytes, "optimizer_state": sum(ledger.optimizer_state_bytes.values()),
            "activations": ledger.activation_bytes or 0}


def part_bytes(row: LedgerRow) -> Dict[str, int]:
    """A ledger row as LEDGER_PARTS -> bytes, the parts not measured left out."""
    values: Dict[str, Optional[int]] = {"parameters_frozen": row["parameters"]["frozen"], "parameters_trainable": row["parameters"]["trainable"],
              "gradients": row["gradients"], "optimizer_state": row["optimizer_state"],
              "activations": row["activations"], "rest": row["rest"], "cache": row["cache"]}
    return {part: int(value) for part in LEDGER_PARTS for value in [values[part]] if value is not None}


def _growth(readings: List[MemoryLedger], first_step: Optional[int]) -> Dict[str, int]:
    """Each counted part's bytes added from the first reading of the measured steps (the one
    in force when they began) to the latest. Gradients are left out: they are bounded by the
    trainable parameters, and the sender sees them come in over the first steps (a reading
    during the first backward has some of them), which is no growth."""
    first = readings[0]
    for reading in readings:
        if first_step is not None and reading.step <= first_step:
            first = reading
    start, end = _parts(first), _parts(readings[-1])
    if first.activation_bytes is None:  # no sample then: activations did not grow, they were not measured
        start["activations"] = end["activations"]
    return {part: end[part] - start[part] for part in end if part != "gradients"}


def _held_by_rank(records: Iterable[StepRecord]) -> Dict[int, _Held]:
    """Per rank, what its memory held at its fullest: on a device, the highest step peak and
    the allocator's cache at that step (reserved minus the peak); else the highest host RSS."""
    device: Dict[int, StepRecord] = {}
    host: Dict[int, int] = {}
    for record in records:
        if record.device_peak_bytes is not None:
            best = device.get(record.rank)
            if best is None or record.device_peak_bytes > (best.device_peak_bytes or 0):
                device[record.rank] = record
        elif record.host_rss_bytes is not None:
            host[record.rank] = max(host.get(record.rank, 0), record.host_rss_bytes)
    held: Dict[int, _Held] = {rank: {"measured_on": "host_rss", "held": rss} for rank, rss in host.items()}
    for rank, record in device.items():
        peak = int(record.device_peak_bytes or 0)
        cache = (max(0, record.device_reserved_bytes - peak) if record.device_reserved_bytes is not None else None)
        held[rank] = {"measured_on": "device_peak", "held": peak, "cache": cache}
    return held


def _adapters(ledger: MemoryLedger, time_shares: Dict[str, Optional[float]]) -> Optional[Adapters]:
    if not ledger.adapter_parameter_bytes:
        return None
    parameter_bytes = ledger.trainable_bytes + ledger.frozen_bytes
    return {"kind": ledger.adapter, "r": ledger.adapter_rank, "count": ledger.adapter_parameters,
            "parameters": ledger.adapter_parameter_bytes, "gradients": ledger.adapter_gradient_bytes,
            "optimizer_state": ledger.adapter_optimizer_bytes,
            "targets": dict(sorted(ledger.adapter_targets.items())),
            "share_of_parameters": (ledger.adapter_parameters / ledger.parameters if ledger.parameters else None),
            "share_of_parameter_bytes": ledger.adapter_parameter_bytes / parameter_bytes if parameter_bytes else None,
            "forward_share": time_shares.get("forward_share"), "backward_share": time_shares.get("backward_share")}


def adapter_time_shares(layers: Sequence[LayerRow]) -> Dict[str, Optional[float]]:
    """Under deep-dive: the adapters' leaf modules' (lora_A, lora_B, lora_dropout) share of the
    time they and the base layers they adapt take, forward and backward (None: no such rows)."""
    sums = {"adapter": [0.0, 0.0], "base": [0.0, 0.0]}
    for row in layers:
        if not row.get("leaf"):
            continue
        group = ("adapter" if adapter_target(row["name"]) is not None
                 else "base" if row["name"].endswith(".base_layer") else None)
        if group is not None:
            sums[group][0] += row["forward_ms"]
            sums[group][1] += row["backward_ms"]
    shares: Dict[str, Optional[float]] = {}
    for index, key in enumerate(("forward_share", "backward_share")):
        total = sums["adapter"][index] + sums["base"][index]
        shares[key] = sums["adapter"][index] / total if total > 0 and sums["base"][index] > 0 else None
    return shares


def ledger_history(ledgers: Sequence[MemoryLedger]) -> List[Dict[str, int]]:
    """Every reading as (rank, step, the counted parts' bytes), for a chart over steps."""
    return [{"rank": ledger.rank, "step": ledger.step, **_parts(ledger)} for ledger in ledgers]
