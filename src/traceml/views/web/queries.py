"""The web dashboard's series, read from the run's store and downsampled in SQL to at most
MAX_POINTS points each, so a page stays light whether the run has a hundred steps or millions.

Series over steps are bucket means over ranks and steps: means, not medians, because the
stacked phases must add up to the step time they stack to. Memory is the bucket's maximum,
so a peak is never averaged away. Every function takes a read-only Store.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Tuple

from traceml.collector.rollup import max_present
from traceml.collector.store import Store
from traceml.records import ALL_PHASES

MAX_POINTS = 2000
MAX_TIMELINE_STEPS = 200
# The order the timeline lays a step's phases out in: the probe measures how long each phase
# took, not when inside the step; the window after the step is input wait, then the rest.
TIMELINE_ORDER = ("h2d", "forward", "backward", "optimizer", "untraced", "input_wait", "outside")
MEMORY_COLUMNS = ("device_allocated_bytes", "device_peak_bytes", "device_reserved_bytes",
                  "host_rss_bytes")


def ranks_of(store: Store) -> List[int]:
    return [row[0] for row in store.query("SELECT rank FROM ranks ORDER BY rank")]


def step_range(store: Store) -> Optional[Tuple[int, int]]:
    """The first and last step any rank reported, from the (rank, step) key: no table scan."""
    lows, highs = [], []
    for rank in ranks_of(store):
        # Two statements: SQLite answers a lone MIN or MAX from the key, not both at once.
        low = store.query("SELECT MIN(step) FROM steps WHERE rank = ?", (rank,))[0][0]
        if low is not None:
            lows.append(low)
            highs.append(store.query("SELECT MAX(step) FROM steps WHERE rank = ?", (rank,))[0][0])
    return (min(lows), max(highs)) if lows else None


def bucket_steps(first: int, last: int, points: int) -> int:
    """Steps per point so that [first, last] takes at most `points` points: a power of two, so
    that a growing run keeps the same buckets (and the cache of them) for as long as possible."""
    span = last - first + 1
    points = max(1, min(points, MAX_POINTS))
    return 1 if span <= points else 1 << math.ceil(math.log2(span / points))


_SUMS = ", ".join(["COUNT(*)", "SUM(step_ms)", "MAX(step_ms)"]
                  + [f"SUM({name}_ms)" for name in ALL_PHASES]
                  + [f"MAX({name})" for name in MEMORY_COLUMNS])


class StepBuckets:
    """Every rank's steps summed per bucket of steps: the source of the step series and of the
    rank heatmap. For the whole run, buckets the slowest rank has passed no longer change, so
    a live refresh reads only the newest few from SQLite, not the whole run again."""

    def __init__(self, store: Store):
        self.store = store
        self.first_step: Optional[int] = None
        self.last_step: Optional[int] = None
        self.bucket = 1
        self._rows: Dict[Tuple[int, int], tuple] = {}  # (rank, slot) -> the _SUMS figures

    def refresh(self, points: int) -> None:
        """Bring the whole run's buckets up to date."""
        known = step_range(self.store)
        if known is None:
            return
        first, last = known
        bucket = bucket_steps(first, last, points)
        if bucket != self.bucket or first != self.first_step:
            self._rows.clear()
            self.bucket, self.first_step = bucket, first
        self.last_step = last
        # From the bucket of the slowest rank's newest step: records behind it may still come.
        newest = [self.store.query("SELECT MAX(step) FROM steps WHERE rank = ?", (rank,))[0][0]
                  for rank in ranks_of(self.store)]
        since_slot = (min(step for step in newest if step is not None) - first) // bucket
        if self._rows:
            since_slot = min(since_slot, max(slot for _, slot in self._rows))
        else:
            since_slot = 0
        for rank in ranks_of(self.store):
            for slot, *figures in self.store.query(
                    f"SELECT (step - ?) / ?, {_SUMS} FROM steps WHERE rank = ? AND step >= ? "
                    f"GROUP BY 1", (first, bucket, rank, first + since_slot * bucket)):
                self._rows[(rank, slot)] = tuple(figures)

    @property
    def training_ms(self) -> float:
        """Step time summed over every rank and step: the run's training time, rank by rank."""
        return sum(figures[1] for figures in self._rows.values())

    @classmethod
    def of_range(cls, store: Store, first: int, last: int, points: int) -> "StepBuckets":
        """The buckets of steps [first, last] only (a zoomed-in view), read by key range."""
        buckets = cls(store)
        buckets.first_step, buckets.last_step = first, last
        buckets.bucket = bucket = bucket_steps(first, last, points)
        for rank in ranks_of(store):
            for slot, *figures in store.query(
                    f"SELECT (step - ?) / ?, {_SUMS} FROM steps WHERE rank = ? AND step BETWEEN ? AND ? "
                    f"GROUP BY 1", (first, bucket, rank, first, last)):
                buckets._rows[(rank, slot)] = tuple(figures)
        return buckets

    def series(self, capacity: Dict[str, Optional[int]]) -> Dict[str, Any]:
        """Across ranks, per bucket: mean step and phase times, the slowest step, peak memory."""
        by_slot: Dict[int, List[tuple]] = {}
        for (_, slot), figures in self._rows.items():
            by_slot.setdefault(slot, []).append(figures)
        series: Dict[str, Any] = {
            "first_step": self.first_step, "last_step": self.last_step, "bucket_steps": self.bucket,
            "step": [], "step_ms": [], "step_max_ms": [], "phases": {name: [] for name in ALL_PHASES},
            "memory": {name: [] for name in MEMORY_COLUMNS}, "capacity": capacity}
        phases_at, memory_at = 3, 3 + len(ALL_PHASES)
        for slot in sorted(by_slot):
            ranks = by_slot[slot]
            count = sum(figures[0] for figures in ranks)
            series["step"].append(self.first_step + slot * self.bucket)
            series["step_ms"].append(sum(figures[1] for figures in ranks) / count)
            series["step_max_ms"].append(max(figures[2] for figures in ranks))
            for offset, name in enumerate(ALL_PHASES):
                series["phases"][name].append(sum(f[phases_at + offset] for f in ranks) / count)
            for offset, name in enumerate(MEMORY_COLUMNS):
                series["memory"][name].append(max_present(f[memory_at + offset] for f in ranks))
        return series

    def heatmap(self) -> Dict[str, Any]:
        """Mean step time per rank and bucket: a slow rank is a bright row."""
        slots = sorted({slot for _, slot in self._rows})
        ranks = sorted({rank for rank, _ in self._rows})
        first = self.first_step or 0
        return {"ranks": ranks, "step": [first + slot * self.bucket for slot in slots],
                "step_ms": [[self._mean_step(rank, slot) for slot in slots] for rank in ranks]}

    def _mean_step(self, rank: int, slot: int) -> Optional[float]:
        figures = self._rows.get((rank, slot))
        return figures[1] / figures[0] if figures else None


def timeline(store: Store, steps: int) -> Dict[str, Any]:
    """Each rank's last `steps` steps with their phases, and the user spans in them."""
    steps = max(1, min(steps, MAX_TIMELINE_STEPS))
    columns = ", ".join(f"{name}_ms" for name in TIMELINE_ORDER)
    ranks, rows = [], []
    first_step: Optional[int] = None
    for rank in ranks_of(store):
        newest = store.query("SELECT MAX(step) FROM steps WHERE rank = ?", (rank,))[0][0]
        if newest is None:
            continue
        ranks.append(rank)
        since = newest - steps + 1
        first_step = since if first_step is None else min(first_step, since)
        for step, start_unix_s, step_ms, *phases in store.query(
                f"SELECT step, start_unix_s, step_ms, {columns} FROM steps "
                f"WHERE rank = ? AND step >= ? ORDER BY step", (rank, since)):
            rows.append({"rank": rank, "step": step, "start_unix_s": start_unix_s, "step_ms": step_ms,
                         "phases": dict(zip(TIMELINE_ORDER, phases))})
    spans = []
    if first_step is not None:
        spans = [{"rank": rank, "step": step, "name": name, "start_unix_s": start_unix_s,
                  "duration_ms": duration_ms, "count": count}
                 for rank, step, name, start_unix_s, duration_ms, count in store.query(
                     "SELECT rank, step, name, start_unix_s, duration_ms, count FROM spans "
                     "WHERE step >= ? ORDER BY rank, step, start_unix_s LIMIT 20000", (first_step,))]
    return {"ranks": ranks, "order": list(TIMELINE_ORDER), "steps": rows, "spans": spans}


def system_series(store: Store, points: int) -> Dict[str, Any]:
    """The node sampler's readings over time, averaged per bucket; GPUs from each bucket's last."""
    low, high, count = store.query("SELECT MIN(rowid), MAX(rowid), COUNT(*) FROM system")[0]
    series: Dict[str, Any] = {"unix_s": [], "cpu_percent": [], "training_cpu_percent": [],
                              "ram_used_bytes": [], "ram_total_bytes": None,
                              "training_rss_bytes": [], "gpus": []}
    if not count:
        return series
    bucket = bucket_steps(low, high, points)
    rows = store.query(
        "SELECT AVG(unix_s), AVG(cpu_percent), AVG(training_cpu_percent), AVG(ram_used_bytes), "
        "MAX(ram_total_bytes), MAX(training_rss_bytes), gpus, MAX(rowid) FROM system "
        "GROUP BY (rowid - ?) / ? ORDER BY 1", (low, bucket))
    gpus: Dict[int, Dict[str, Any]] = {}
    for index, (unix_s, cpu, training_cpu, ram_used, ram_total, training_rss, gpu_json, _) in enumerate(rows):
        series["unix_s"].append(unix_s)
        series["cpu_percent"].append(cpu)
        series["training_cpu_percent"].append(training_cpu)
        series["ram_used_bytes"].append(round(ram_used))
        series["training_rss_bytes"].append(training_rss)
        series["ram_total_bytes"] = ram_total
        for gpu in json.loads(gpu_json or "[]"):
            line = gpus.setdefault(gpu["index"], {
                "index": gpu["index"], "memory_total_bytes": gpu["memory_total_bytes"],
                **{name: [None] * index for name in ("utilization_percent", "memory_used_bytes",
                                                     "temperature_c", "power_w")}})
            for name in ("utilization_percent", "memory_used_bytes", "temperature_c", "power_w"):
                line[name].append(gpu.get(name))
        for line in gpus.values():  # a GPU missing from this reading: a gap, not a shift
            for name in ("utilization_percent", "memory_used_bytes", "temperature_c", "power_w"):
                if len(line[name]) <= index:
                    line[name].append(None)
    series["gpus"] = [gpus[index] for index in sorted(gpus)]
    return series


def span_table(store: Store, training_ms: float) -> Dict[str, Any]:
    """Each user span: calls, the steps it was in, mean time a call, and its share of the
    training time (step time summed over ranks, StepBuckets.training_ms)."""
    rows = store.query("SELECT name, SUM(count), COUNT(*), SUM(duration_ms) FROM spans "
                       "GROUP BY name ORDER BY SUM(duration_ms) DESC")
    return {"spans": [{"name": name, "count": count, "steps": steps,
                       "mean_ms": total_ms / count if count else 0.0, "total_ms": total_ms,
                       "share": total_ms / training_ms if training_ms else 0.0}
                      for name, count, steps, total_ms in rows]}


def scalar_series(store: Store, points: int) -> Dict[str, Any]:
    """Each logged scalar over steps, bucket means over ranks and steps."""
    scalars: Dict[str, Any] = {}
    for (name,) in store.query("SELECT DISTINCT name FROM scalars ORDER BY name"):
        first, last = store.query("SELECT MIN(step), MAX(step) FROM scalars WHERE name = ?", (name,))[0]
        bucket = bucket_steps(first, last, points)
        rows = store.query("SELECT MIN(step), AVG(value) FROM scalars WHERE name = ? "
                           "GROUP BY (step - ?) / ? ORDER BY 1", (name, first, bucket))
        scalars[name] = {"step": [row[0] for row in rows], "value": [row[1] for row in rows]}
    return {"scalars": scalars}
