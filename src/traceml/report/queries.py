"""The web dashboard's series, read from the run's store and downsampled in SQL to at most
MAX_POINTS points each, so a page stays light whether the run has a hundred steps or millions.

Series over steps are bucket means over ranks and steps: means, not medians, because the
stacked phases must add up to the step time they stack to. Memory is the bucket's maximum,
so a peak is never averaged away. Every function takes a read-only Store.
"""
from __future__ import annotations

import math

import msgspec
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, TypedDict

from traceml.analysis.rollup import max_present
from traceml.collector.store import BUCKET_FIGURES, Row, SeriesKey, Store
from traceml.records import ALL_PHASES, TIMELINE_ORDER, RankHello

MAX_POINTS = 2000
MAX_TIMELINE_STEPS = 200
MEMORY_COLUMNS = ("device_allocated_bytes", "device_peak_bytes", "device_reserved_bytes",
                  "host_rss_bytes")
Figures = Row  # a bucket's figures as SQLite sums them: numbers, or NULL (None)
Merge = Callable[[Iterable[float]], Optional[float]]
# How two buckets' figures merge into one (the store's BUCKET_FIGURES say which each takes).
MERGES: Dict[str, Merge] = {"sum": sum, "max": max_present, "min": min}
_PHASES_AT, _MEMORY_AT = 3, 3 + len(ALL_PHASES)  # where the steps' bucket figures put them


def bucket_steps(first: int, last: int, points: int) -> int:
    """Steps per point so that [first, last] takes at most `points` points: a power of two, so
    that a growing run keeps the same buckets (and the cache of them) for as long as possible."""
    span = last - first + 1
    points = max(1, min(points, MAX_POINTS))
    return 1 if span <= points else 1 << math.ceil(math.log2(span / points))


class Buckets:
    """One table's rows summed per series (a rank, a span or scalar name) and bucket of steps.

    Each (series, step) pair is indexed, so a series' step range costs two lookups and its
    buckets one range scan. The whole run is kept at the finest resolution (MAX_POINTS) and
    coarsened on request. Buckets every rank had moved past at the last refresh no longer
    change: a refresh reads again only from the bucket of the step they had all reached then.
    """

    def __init__(self, store: Store, table: str, read: Optional[Callable[..., List[Figures]]] = None,
                 merges: Optional[List[Merge]] = None):
        self.store, self.table = store, table
        self.merges = merges or [MERGES[merge] for _, merge in BUCKET_FIGURES[table]]
        # read(key, first, bucket, low[, high]) -> [(slot, *figures)]: the store's sums in SQL
        # (BUCKET_FIGURES), or a reader of figures the store does not sum (own_time_buckets).
        self.read = read or (lambda key, *span: store.bucketed(table, key, *span))
        self.first_step: Optional[int] = None
        self.last_step: Optional[int] = None
        self.bucket = 1
        self.rows: Dict[Tuple[SeriesKey, int], Figures] = {}  # (series, slot) -> figures
        # The newest step every rank had reported when the rows were last read: the rows before
        # its bucket were complete then, and never change.
        self.settled: Optional[int] = None

    def refresh(self, points: int = MAX_POINTS) -> None:
        """Bring the whole run's buckets up to date."""
        ranges = {key: (low, high) for key in self.store.series_keys(self.table)
                  for low, high in [self.store.step_bounds(self.table, key)] if low is not None and high is not None}
        if not ranges:
            return
        first = min(low for low, _ in ranges.values())
        last = max(high for _, high in ranges.values())
        bucket = bucket_steps(first, last, points)
        if first != self.first_step or bucket < self.bucket:
            self.rows.clear()
            self.bucket, self.first_step = bucket, first
        elif bucket > self.bucket:  # the run doubled: pairs of buckets merge, nothing is re-read
            self.rows = self._merged(bucket // self.bucket)
            self.bucket = bucket
        self.last_step = last
        settled_now = settled_step(self.store)  # before reading: all it covers is in what is read
        since_slot = 0
        if self.rows and self.settled is not None:
            since_slot = max(0, min((self.settled - first) // bucket, max(slot for _, slot in self.rows)))
        for key in ranges:
            for slot, *figures in self.read(key, first, bucket, first + since_slot * bucket):
                self.rows[(key, slot)] = tuple(figures)
        self.settled = settled_now

    def read_range(self, first: int, last: int, points: int) -> "Buckets":
        """These buckets for steps [first, last] only (a zoomed-in view), read by key range."""
        self.first_step, self.last_step = first, last
        self.bucket = bucket = bucket_steps(first, last, points)
        self.rows.clear()
        for key in self.store.series_keys(self.table):
            for slot, *figures in self.read(key, first, bucket, first, last):
                self.rows[(key, slot)] = tuple(figures)
        return self

    def coarsen(self, points: int) -> "Buckets":
        """These buckets merged into at most `points` per series (bucket sizes are powers of
        two, so each coarse bucket is a whole number of fine ones)."""
        if self.first_step is None or self.last_step is None:
            return self
        bucket = bucket_steps(self.first_step, self.last_step, points)
        if bucket <= self.bucket:
            return self
        coarse = Buckets(self.store, self.table, self.read, self.merges)
        coarse.first_step, coarse.last_step, coarse.bucket = self.first_step, self.last_step, bucket
        coarse.rows = self._merged(bucket // self.bucket)
        return coarse

    def _merged(self, factor: int) -> Dict[Tuple[SeriesKey, int], Figures]:
        """The rows with every `factor` neighbouring buckets of a series merged into one."""
        groups: Dict[Tuple[SeriesKey, int], List[Figures]] = {}
        for (key, slot), figures in self.rows.items():
            groups.setdefault((key, slot // factor), []).append(figures)
        return {slot: tuple(merge(column) for merge, column in zip(self.merges, zip(*group)))
                for slot, group in groups.items()}

    def by_slot(self) -> Dict[int, List[Figures]]:
        slots: Dict[int, List[Figures]] = {}
        for (_, slot), figures in self.rows.items():
            slots.setdefault(slot, []).append(figures)
        return dict(sorted(slots.items()))

    def step_of(self, slot: int) -> int:
        return (self.first_step or 0) + slot * self.bucket


# -- steps ----------------------------------------------------------------------------------------
def step_buckets(store: Store) -> Buckets:
    return Buckets(store, "steps")


def step_range(store: Store) -> Optional[Tuple[int, int]]:
    """The first and last step any rank reported."""
    ranges = [(low, high) for rank in store.ranks() for low, high in [store.step_bounds("steps", rank)]
              if low is not None and high is not None]
    return (min(low for low, _ in ranges), max(high for _, high in ranges)) if ranges else None


def settled_step(store: Store) -> Optional[int]:
    """The newest step every rank has reported: what comes later may still change. None while
    a rank of the run has reported no step (its first steps may still come, from step 0)."""
    world_size = max((hello.world_size for hello in store.records(RankHello)), default=0)
    newest = [store.step_bounds("steps", rank)[1] for rank in store.ranks()]
    known = [step for step in newest if step is not None]
    if not newest or len(known) < len(newest) or len(newest) < world_size:
        return None
    return min(known)


class _StepSeries(TypedDict):
    first_step: Optional[int]
    last_step: Optional[int]
    bucket_steps: int
    step: List[int]  # each bucket's first step
    step_ms: List[float]  # mean over ranks and steps
    step_max_ms: List[float]
    phases: Dict[str, List[float]]
    memory: Dict[str, List[Optional[float]]]  # the bucket's maximum
    capacity: Dict[str, Optional[int]]


class StepSeries(_StepSeries, total=False):
    """The steps over the run, per bucket (the web page's step chart)."""

    warmup_steps: int  # the whole run's series: the first steps the summary leaves out


def step_series(buckets: Buckets, capacity: Dict[str, Optional[int]]) -> StepSeries:
    """Across ranks, per bucket: mean step and phase times, the slowest step, peak memory."""
    series: StepSeries = {
        "first_step": buckets.first_step, "last_step": buckets.last_step,
        "bucket_steps": buckets.bucket, "step": [], "step_ms": [], "step_max_ms": [],
        "phases": {name: [] for name in ALL_PHASES}, "memory": {name: [] for name in MEMORY_COLUMNS},
        "capacity": capacity}
    for slot, ranks in buckets.by_slot().items():
        count = sum(figures[0] for figures in ranks)
        series["step"].append(buckets.step_of(slot))
        series["step_ms"].append(sum(figures[1] for figures in ranks) / count)
        series["step_max_ms"].append(max(figures[2] for figures in ranks))
        for offset, name in enumerate(ALL_PHASES):
            series["phases"][name].append(sum(f[_PHASES_AT + offset] for f in ranks) / count)
        for offset, column in enumerate(MEMORY_COLUMNS):
            series["memory"][column].append(max_present(f[_MEMORY_AT + offset] for f in ranks))
    return series


def own_time_buckets(store: Store) -> Buckets:
    """Per rank and bucket of steps: (steps, own time summed, steps whose comm wait was
    measured). A rank's own time is its step less the time it waited inside backward for the
    other ranks' gradients: under DDP every rank's step takes as long as the slowest's, so only
    this tells the rank the others wait for. Where comm wait is not measured it is the step."""

    def read(rank: int, first: int, bucket: int, low: int, high: int = 2 ** 62) -> List[Figures]:
        slots: Dict[int, List[float]] = {}
        for step, step_ms, comm_wait_ms in store.step_fields(rank, low, ("step_ms", "comm_wait_ms")):
            if step > high:
                break
            figures = slots.setdefault((step - first) // bucket, [0, 0.0, 0])
            figures[0] += 1
            figures[1] += step_ms - (comm_wait_ms or 0.0)
            figures[2] += comm_wait_ms is not None
        return [(slot, *figures) for slot, figures in slots.items()]

    return Buckets(store, "steps", read, [sum, sum, sum])


class RankHeatmap(TypedDict):
    ranks: List[SeriesKey]
    step: List[int]
    own_ms: List[List[Optional[float]]]  # rank -> bucket -> mean own time (None: no step there)
    comm_wait_measured: bool


def rank_heatmap(buckets: Buckets) -> RankHeatmap:
    """Mean own time (see own_time_buckets) per rank and bucket: the slow rank is a bright row."""
    slots = sorted({slot for _, slot in buckets.rows})
    ranks = sorted({rank for rank, _ in buckets.rows})

    def mean_ms(rank: SeriesKey, slot: int) -> Optional[float]:
        figures = buckets.rows.get((rank, slot))
        return figures[1] / figures[0] if figures else None

    comm_wait_measured = any(figures[2] for figures in buckets.rows.values())
    return {"ranks": ranks, "step": [buckets.step_of(slot) for slot in slots],
            "own_ms": [[mean_ms(rank, slot) for slot in slots] for rank in ranks],
            "comm_wait_measured": comm_wait_measured}


def training_ms(buckets: Buckets) -> float:
    """Step time summed over every rank and step: the run's training time, rank by rank."""
    return float(sum(figures[1] for figures in buckets.rows.values()))


class TimelineStep(TypedDict):
    rank: int
    step: int
    start_unix_s: float
    step_ms: float
    phases: Dict[str, float]  # in TIMELINE_ORDER


class Timeline(TypedDict):
    ranks: List[int]
    order: List[str]
    steps: List[TimelineStep]
    spans: List[Dict[str, object]]  # SpanRecord's fields


def timeline(store: Store, steps: int) -> Timeline:
    """Each rank's last `steps` steps with their phases, and the user spans in them."""
    steps = max(1, min(steps, MAX_TIMELINE_STEPS))
    fields = ["start_unix_s", "step_ms", *(f"{name}_ms" for name in TIMELINE_ORDER)]
    ranks: List[int] = []
    rows: List[TimelineStep] = []
    first_step: Optional[int] = None
    for rank in store.ranks():
        newest = store.step_bounds("steps", rank)[1]
        if newest is None:
            continue
        ranks.append(rank)
        since = newest - steps + 1
        first_step = since if first_step is None else min(first_step, since)
        for step, start_unix_s, step_ms, *phases in store.step_fields(rank, since, fields):
            rows.append({"rank": rank, "step": step, "start_unix_s": start_unix_s, "step_ms": step_ms,
                         "phases": dict(zip(TIMELINE_ORDER, phases))})
    spans: List[Dict[str, object]] = []
    if first_step is not None:
        spans = [msgspec.structs.asdict(span) for span in store.spans_between(first_step, 2 ** 62, limit=20000)]
    return {"ranks": ranks, "order": list(TIMELINE_ORDER), "steps": rows, "spans": spans}


# -- user spans and scalars ------------------------------------------------------------------------
def span_buckets(store: Store) -> Buckets:
    return Buckets(store, "spans")


class SpanRow(TypedDict):
    name: str
    count: int
    steps: int  # the (rank, step) pairs it was in
    mean_ms: float  # a call
    total_ms: float
    share: float  # of the training time


class SpanTable(TypedDict):
    spans: List[SpanRow]


def span_table(buckets: Buckets, training_ms: float) -> SpanTable:
    """Each user span: calls, the (rank, step) pairs it was in, mean time a call, and its share
    of the training time (step time summed over ranks)."""
    totals: Dict[str, List[float]] = {}
    for (name, _), (calls, steps, total_ms) in buckets.rows.items():
        entry = totals.setdefault(str(name), [0, 0, 0.0])
        entry[0] += calls
        entry[1] += steps
        entry[2] += total_ms
    rows: List[SpanRow] = [{"name": name, "count": int(calls), "steps": int(steps),
             "mean_ms": total_ms / calls if calls else 0.0, "total_ms": total_ms,
             "share": total_ms / training_ms if training_ms else 0.0}
            for name, (calls, steps, total_ms) in totals.items()]
    return {"spans": sorted(rows, key=lambda row: -row["total_ms"])}


def scalar_buckets(store: Store) -> Buckets:
    return Buckets(store, "scalars")


class ScalarLine(TypedDict):
    step: List[int]
    value: List[float]


class ScalarSeries(TypedDict):
    scalars: Dict[str, ScalarLine]


def scalar_series(buckets: Buckets) -> ScalarSeries:
    """Each logged scalar over steps: per bucket, its mean over ranks and steps."""
    scalars: Dict[str, ScalarLine] = {}
    for (name, _), (first_step, count, total) in sorted(buckets.rows.items()):
        series = scalars.setdefault(str(name), {"step": [], "value": []})
        series["step"].append(first_step)
        series["value"].append(total / count)
    return {"scalars": scalars}


# -- the node ------------------------------------------------------------------------------------
class SystemSeries(TypedDict, total=False):
    """The node sampler's readings over time (the web page's system chart)."""

    unix_s: List[float]
    cpu_percent: List[float]
    training_cpu_percent: List[float]
    ram_used_bytes: List[int]
    ram_total_bytes: Optional[int]
    training_rss_bytes: List[int]
    gpus: List[Dict[str, object]]  # index, memory_total_bytes and a list per GPU_FIGURES name
    cpu_count: Optional[int]  # the run source adds it, from the latest reading


def system_series(store: Store, points: int) -> SystemSeries:
    """The node sampler's readings over time, averaged per bucket; GPUs from each bucket's last."""
    series: SystemSeries = {"unix_s": [], "cpu_percent": [], "training_cpu_percent": [],
                              "ram_used_bytes": [], "ram_total_bytes": None,
                              "training_rss_bytes": [], "gpus": []}
    low, high = store.system_extent()
    gpu_fields = ("utilization_percent", "memory_used_bytes", "temperature_c", "power_w")
    gpus: Dict[int, Dict[str, Any]] = {}  # a GPU's index and total, and a list per figure
    for index, (sample, _) in enumerate(store.system_buckets(low, bucket_steps(low, high, points))):
        series["unix_s"].append(sample.unix_s)
        series["cpu_percent"].append(sample.cpu_percent)
        series["training_cpu_percent"].append(sample.training_cpu_percent)
        series["ram_used_bytes"].append(sample.ram_used_bytes)
        series["training_rss_bytes"].append(sample.training_rss_bytes)
        series["ram_total_bytes"] = sample.ram_total_bytes
        for gpu in sample.gpus:
            line = gpus.setdefault(gpu.index, {"index": gpu.index, "memory_total_bytes": gpu.memory_total_bytes,
                                               **{name: [None] * index for name in gpu_fields}})
            for name in gpu_fields:
                line[name].append(getattr(gpu, name))
        for line in gpus.values():  # a GPU missing from this reading: a gap, not a shift
            for name in gpu_fields:
                if len(line[name]) <= index:
                    line[name].append(None)
    series["gpus"] = [gpus[index] for index in sorted(gpus)]
    return series
