"""Rollup: each step across ranks (median and worst), and the statistics of a window of steps.

Everything a view or a diagnosis rule needs about step time is computed here once: the rules
and the summary read the same Window, so the card and the verdict can never disagree.
"""
from __future__ import annotations

import collections
import functools
import operator
import statistics
import time
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, TypedDict, TypeVar, Union, cast

import msgspec

from traceml.analysis.bootstrap import share_interval
from traceml.records import ALL_PHASES, RolledStep, StepRecord



class PhaseStats(msgspec.Struct):
    median_ms: float
    mean_ms: float
    share: float  # of the window's total step time


def roll_up(records: Iterable[StepRecord]) -> List[RolledStep]:
    """Group records by step (any order) into RolledSteps, in step order."""
    by_step: Dict[int, List[StepRecord]] = {}
    for record in records:
        by_step.setdefault(record.step, []).append(record)
    return [_roll_step(step, by_step[step]) for step in sorted(by_step)]


# One rank (most runs): a rolled step is that rank's own figures, read in RolledStep's field
# order after `step` and `ranks` in one call, the collector's largest cost per step otherwise.
_ONE_RANK_NAMES = {"worst_rank": "rank", "worst_step_ms": "step_ms"}
_ONE_RANK_FIGURES = operator.attrgetter(*[_ONE_RANK_NAMES.get(field.name, field.name)
                                          for field in msgspec.structs.fields(RolledStep)[2:]])


def _roll_step(step: int, ranks: List[StepRecord]) -> RolledStep:
    if len(ranks) == 1:
        return RolledStep(step, 1, *_ONE_RANK_FIGURES(ranks[0]))
    def median(name: str) -> float:
        return float(statistics.median(getattr(r, name) for r in ranks))

    worst = max(ranks, key=lambda r: r.step_ms)
    return RolledStep(
        step=step,
        ranks=len(ranks),
        start_unix_s=min(r.start_unix_s for r in ranks),
        step_ms=median("step_ms"),
        worst_rank=worst.rank,
        worst_step_ms=worst.step_ms,
        input_wait_ms=median("input_wait_ms"),
        outside_ms=median("outside_ms"),
        h2d_ms=median("h2d_ms"),
        forward_ms=median("forward_ms"),
        backward_ms=median("backward_ms"),
        optimizer_ms=median("optimizer_ms"),
        untraced_ms=median("untraced_ms"),
        gc_ms=median("gc_ms"),
        gc_collections=median("gc_collections"),
        gc_max_pause_ms=max(r.gc_max_pause_ms for r in ranks),
        gc_gen2_ms=median("gc_gen2_ms"),
        samples=sum(r.samples for r in ranks),
        device_timed=any(r.device_timed for r in ranks),
        gpu_idle_ms=_median_present(r.gpu_idle_ms for r in ranks),
        device_allocated_bytes=max_present(r.device_allocated_bytes for r in ranks),
        device_peak_bytes=max_present(r.device_peak_bytes for r in ranks),
        device_reserved_bytes=max_present(r.device_reserved_bytes for r in ranks),
        host_rss_bytes=max_present(r.host_rss_bytes for r in ranks),
        tokens=sum(r.tokens for r in ranks),
        real_tokens=_sum_present(r.real_tokens for r in ranks),
        eval_ms=median("eval_ms"),
        checkpoint_ms=median("checkpoint_ms"),
        instrumented=any(r.instrumented for r in ranks),
        compile_ms=median("compile_ms"),
        comm_wait_ms=median("comm_wait_ms") if all(r.comm_wait_ms is not None for r in ranks) else None,
        forward_comm_wait_ms=median("forward_comm_wait_ms"),
    )


# A step as a Window holds it: rolled up across ranks, or one rank's own record.
WindowStep = Union[RolledStep, StepRecord]


class Window:
    """A run of rolled-up steps and their statistics, computed once for every reader. One
    rank's own StepRecords make a window too (they carry every field read here)."""

    def __init__(self, steps: Sequence[WindowStep]):
        self.steps = steps
        self.step_times_ms = sorted(s.step_ms for s in steps)
        self.total_ms = sum(self.step_times_ms)
        self.phases: Dict[str, PhaseStats] = {name: self._phase(name) for name in ALL_PHASES}
        # The wait for collectives inside the compute phases (DDP, FSDP): not compute. Zero
        # where it is not measured.
        self.comm_wait: PhaseStats = self._phase("comm_wait")

    def __len__(self) -> int:
        return len(self.steps)

    def _phase(self, name: str) -> PhaseStats:
        values = [getattr(s, f"{name}_ms") or 0.0 for s in self.steps]
        if not values:
            return PhaseStats(0.0, 0.0, 0.0)
        total = sum(values)
        return PhaseStats(median_ms=statistics.median(values), mean_ms=total / len(values),
                          share=total / self.total_ms if self.total_ms > 0 else 0.0)

    @property
    def step_median_ms(self) -> float:
        return statistics.median(self.step_times_ms) if self.step_times_ms else 0.0

    @property
    def step_mean_ms(self) -> float:
        return self.total_ms / len(self.step_times_ms) if self.step_times_ms else 0.0

    @property
    def step_p90_ms(self) -> float:
        return percentile(self.step_times_ms, 0.90)

    @property
    def steps_per_s(self) -> float:
        return len(self.steps) * 1000.0 / self.total_ms if self.total_ms > 0 else 0.0

    @property
    def samples_per_s(self) -> Optional[float]:
        """The global batch (summed over ranks) per second; None when no batch size was seen."""
        samples = sum(s.samples for s in self.steps)
        return samples * 1000.0 / self.total_ms if samples and self.total_ms > 0 else None

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Real tokens trained a second (labels not -100, or per attention_mask; all the positions
        trained where neither is given), summed over ranks; None without token inputs."""
        tokens = sum(s.tokens if s.real_tokens is None else s.real_tokens for s in self.steps)
        return tokens * 1000.0 / self.total_ms if tokens and self.total_ms > 0 else None

    @property
    def padding_share(self) -> Optional[float]:
        """Of the tokens in steps with real tokens counted (labels, a mask), the share not trained."""
        masked = [s for s in self.steps if s.real_tokens is not None and s.tokens]
        given = sum(s.tokens for s in masked)
        return 1.0 - sum(s.real_tokens or 0 for s in masked) / given if given else None

    @functools.cached_property
    def memory_trend(self) -> "MemoryTrend":
        """What each step leaves behind: device memory allocated at step end, or without a
        device, host RSS; and its robust slope in bytes per step."""
        device = [(s.step, s.device_allocated_bytes) for s in self.steps
                  if s.device_allocated_bytes is not None]
        rss = [(s.step, s.host_rss_bytes) for s in self.steps if s.host_rss_bytes]
        # Device memory is read at each step's end; host RSS by the sender thread every 20 ms,
        # and a busy machine can leave that thread waiting for many steps. A repeated RSS
        # figure is the same reading again, not a new one: each reading counts once, at the
        # first step that carried it, so a stalled reader makes no flat stretch in the trend.
        series = device or [(step, held) for index, (step, held) in enumerate(rss)
                            if index == 0 or held != rss[index - 1][1]]
        steps, held = [x for x, _ in series], [y for _, y in series]
        return MemoryTrend(measured_on="device_allocated" if device else "host_rss", steps=steps,
                           held_bytes=held, bytes_per_step=robust_slope(steps, held),
                           window_steps=len(device or rss))

    def share(self, *names: str) -> float:
        return sum(self.phases[name].share for name in names)

    def share_interval(self, *names: str) -> Tuple[float, float]:
        """The 95% interval of these phases' share of the step, steps resampled in blocks."""
        return share_interval([sum(getattr(s, f"{name}_ms") for name in names) for s in self.steps],
                              [s.step_ms for s in self.steps])

    def mean_ms(self, *names: str) -> float:
        return sum(self.phases[name].mean_ms for name in names)


class MemoryTrend(msgspec.Struct):
    measured_on: str  # device_allocated | host_rss
    steps: List[int]
    held_bytes: List[int]
    bytes_per_step: float
    window_steps: int = 0  # steps that carried a reading (held_bytes has one per distinct RSS reading)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values."""
    if not sorted_values:
        return 0.0
    position = (len(sorted_values) - 1) * q
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class RankRow(TypedDict):
    """One rank's own figures, warm-up left out: what the straggler rule, the card's and the
    report's rank tables and the dashboards' rank panels read (a dict: it goes into
    final_summary.json as it is)."""

    rank: int
    steps: int  # after warm-up
    last_step: int
    step_median_ms: Optional[float]
    behind_share: float  # of the steps in which the others waited for this rank
    input_wait_median_ms: Optional[float]
    outside_median_ms: Optional[float]
    h2d_median_ms: Optional[float]
    forward_median_ms: Optional[float]
    backward_median_ms: Optional[float]
    optimizer_median_ms: Optional[float]
    untraced_median_ms: Optional[float]
    gc_median_ms: Optional[float]
    comm_wait_median_ms: Optional[float]  # None unless measured (DDP, FSDP on the CPU)
    forward_comm_wait_median_ms: Optional[float]  # of it, in forward (FSDP's all-gathers)
    optimizer_comm_wait_median_ms: Optional[float]  # ... and in the optimizer (DeepSpeed ZeRO's all-gathers)
    cpu_wait_median_ms: Optional[float]  # its training thread's wait for a CPU (None: not known)
    on_cpu_median_ms: Optional[float]  # ... and its time on one


def comm_wait_parts(row: RankRow) -> Dict[str, float]:
    """A rank's median comm wait by phase: forward (FSDP's all-gathers), optimizer (ZeRO's
    all-gathers) and backward, the rest of it (0.0 where not measured)."""
    forward_ms = row.get("forward_comm_wait_median_ms") or 0.0
    optimizer_ms = row.get("optimizer_comm_wait_median_ms") or 0.0
    backward_ms = max(0.0, (row.get("comm_wait_median_ms") or 0.0) - forward_ms - optimizer_ms)
    return {"forward": forward_ms, "backward": backward_ms, "optimizer": optimizer_ms}


def rank_row(rank: int, records: Sequence[StepRecord], last_step: int, behind_share: float = 0.0) -> RankRow:
    """A rank's row from its records after warm-up (none: its medians are None)."""
    medians = {f"{name}_median_ms": _median_of(records, f"{name}_ms") for name in
               ALL_PHASES + ("comm_wait", "forward_comm_wait", "optimizer_comm_wait", "cpu_wait", "on_cpu")}
    # Built as a dict, its keys in RankRow's order: a TypedDict cannot be keyed by a phase's name.
    return cast(RankRow, {"rank": rank, "steps": len(records), "last_step": last_step,
                          "step_median_ms": _median_of(records, "step_ms"), "behind_share": behind_share,
                          **medians})


def rank_median_ms(row: RankRow, key: str) -> Optional[float]:
    """A rank's median named by its key ("step_median_ms", "forward_median_ms"); None where not
    measured, or missing from a row an older run wrote."""
    return cast(Mapping[str, Optional[float]], row).get(key)


def rank_medians(records: Iterable[StepRecord], skip_steps: int) -> List[RankRow]:
    """Each rank's own median step and phase times, warm-up left out, and its last step."""
    by_rank: Dict[int, List[StepRecord]] = {}
    last_step: Dict[int, int] = {}
    for record in records:
        last_step[record.rank] = max(last_step.get(record.rank, -1), record.step)
        if record.step >= skip_steps:
            by_rank.setdefault(record.rank, []).append(record)
    behind = _times_behind(by_rank)
    return [rank_row(rank, by_rank.get(rank, []), last_step[rank], behind.get(rank, 0.0))
            for rank in sorted(last_step)]


def _times_behind(by_rank: Dict[int, List[StepRecord]]) -> Dict[int, float]:
    """For each rank, the share of steps in which the others waited for it: it had the least
    collective wait (or, untimed, the most own work outside backward). By chance 1/ranks;
    a real straggler is behind in most steps."""
    by_step: Dict[int, List[StepRecord]] = {}
    for records in by_rank.values():
        for record in records:
            by_step.setdefault(record.step, []).append(record)
    full = [ranks for ranks in by_step.values() if len(ranks) == len(by_rank) > 1]
    if not full:
        return {}
    counts: Dict[int, int] = {}
    for ranks in full:
        if all(r.comm_wait_ms is not None for r in ranks):
            last = min(ranks, key=lambda r: r.comm_wait_ms or 0.0)  # every one measured
        else:
            last = max(ranks, key=lambda r: r.step_ms - r.backward_ms)
        counts[last.rank] = counts.get(last.rank, 0) + 1
    return {rank: count / len(full) for rank, count in counts.items()}


class Spread(TypedDict):
    """One phase's (or memory figure's) spread across ranks, the typical step's."""

    median: float
    worst: float
    worst_rank: int
    skew: float  # worst minus median


def rank_spread(records: Iterable[StepRecord], skip_steps: int) -> Dict[str, Spread]:
    """Per phase (and memory): across ranks, the typical median, the typical worst, the rank
    that is most often the worst, and the skew (worst minus median), over the steps."""
    by_step: Dict[int, List[StepRecord]] = {}
    for record in records:
        if record.step >= skip_steps:
            by_step.setdefault(record.step, []).append(record)
    steps = [ranks for ranks in by_step.values() if len(ranks) > 1]
    spread: Dict[str, Spread] = {}
    fields = [f"{name}_ms" for name in ("step",) + ALL_PHASES + ("comm_wait",)]
    for name in fields + ["device_peak_bytes", "host_rss_bytes"]:
        medians, worsts, worst_ranks = [], [], []
        for ranks in steps:
            present = [r for r in ranks if getattr(r, name) is not None]
            if len(present) < 2:
                continue
            worst = max(present, key=lambda r: getattr(r, name))
            medians.append(statistics.median(getattr(r, name) for r in present))
            worsts.append(getattr(worst, name))
            worst_ranks.append(worst.rank)
        if not medians:
            continue
        key = name[:-3] if name.endswith("_ms") else name
        spread[key] = {"median": statistics.median(medians), "worst": statistics.median(worsts),
                       "worst_rank": statistics.mode(worst_ranks),
                       "skew": statistics.median(w - m for w, m in zip(worsts, medians))}
    return spread


def _median_of(records: Sequence[StepRecord], name: str) -> Optional[float]:
    return _median_present(getattr(r, name) for r in records)


def robust_slope(xs: Sequence[float], ys: Sequence[float], max_points: int = 200) -> float:
    """Theil-Sen slope (median of pairwise slopes) on at most max_points evenly spaced points.

    Robust to the one-off jumps of a caching allocator, unlike a least-squares fit.
    """
    if len(xs) < 2:
        return 0.0
    stride = max(1, len(xs) // max_points)
    px, py = xs[::stride], ys[::stride]
    slopes = [(py[j] - py[i]) / (px[j] - px[i])
              for i in range(len(px)) for j in range(i + 1, len(px)) if px[j] != px[i]]
    return statistics.median(slopes) if slopes else 0.0


def _median_present(values: Iterable[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _sum_present(values: Iterable[Optional[int]]) -> Optional[int]:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


Number = TypeVar("Number", int, float)


def max_present(values: Iterable[Optional[Number]]) -> Optional[Number]:
    """The largest of the values that are there (memory readings may be missing), or None."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


class LiveRollup:
    """Steps rolled up across ranks as their records arrive: for the live views, and, written
    to the store as they roll, for the final summary (which then need not roll them again).

    A step is rolled once every rank of the run has reported it, or once it is stale_after
    steps behind the newest step seen and stale_s seconds old (a rank that died or fell far
    behind: ranks send every 100 ms, so fast steps of one rank run far ahead of another's
    frame without anything being wrong). A record that
    comes for a step already rolled is noted in late_steps, to be rolled again from the store
    at the end. Only the last keep_steps rolled steps are kept here, so memory stays bounded
    however long the run.
    """

    def __init__(self, keep_steps: int = 4096, stale_after: int = 64, stale_s: float = 2.0):
        self.world_size = 1
        self.recent: "collections.deque[RolledStep]" = collections.deque(maxlen=keep_steps)
        self.rolled_at: "collections.deque[float]" = collections.deque(maxlen=keep_steps)
        self.stale_after, self.stale_s = stale_after, stale_s
        self.newest_step = -1
        self._first_seen: Dict[int, float] = {}  # pending step -> when its first record came
        self.rolled_out: List[RolledStep] = []  # rolled since the collector last took them
        self.late_steps: Set[int] = set()
        self._rolled_through = -1
        self._pending: Dict[int, Dict[int, StepRecord]] = {}

    def add(self, records: Iterable[StepRecord]) -> None:
        for record in records:
            ranks = self._pending.get(record.step)
            if ranks is None:
                if record.step <= self._rolled_through:
                    self.late_steps.add(record.step)  # rolled without it: again at the end
                    continue
                ranks = self._pending[record.step] = {}
                self._first_seen[record.step] = time.monotonic()
            ranks[record.rank] = record
            if record.step > self.newest_step:
                self.newest_step = record.step
            if len(ranks) >= self.world_size:
                self._roll(record.step)
        old_enough = time.monotonic() - self.stale_s
        stale = [step for step in self._pending if step <= self.newest_step - self.stale_after
                 and self._first_seen[step] <= old_enough]
        for step in sorted(stale):
            self._roll(step)

    def _roll(self, step: int) -> None:
        ranks = self._pending.pop(step)
        del self._first_seen[step]
        rolled = _roll_step(step, list(ranks.values()))
        self.recent.append(rolled)
        self.rolled_out.append(rolled)
        self.rolled_at.append(time.monotonic())
        if step > self._rolled_through:
            self._rolled_through = step

    def flush(self) -> None:
        """The run is over: roll what is still waiting for a rank that will not come."""
        for step in sorted(self._pending):
            self._roll(step)

    def take_rolled(self) -> List[RolledStep]:
        rolled, self.rolled_out = self.rolled_out, []
        return rolled

    def finish(self, steps_at: Callable[[List[int]], List[StepRecord]]) -> List[RolledStep]:
        """The run is over: what still waits, rolled, and every step a late record reached after
        it was rolled, rolled again from every rank's records (`steps_at`, the store's), so the
        rolled steps kept are every step's, across every rank that sent it."""
        self.flush()
        rolled = self.take_rolled()
        late = sorted(self.late_steps)
        for first in range(0, len(late), 500):
            rolled += roll_up(steps_at(late[first:first + 500]))
        return rolled

    @property
    def pending_steps(self) -> int:
        return len(self._pending)
