"""Moving-block bootstrap over a run's steps: how sure a figure read from them is.

Neighbouring steps are not independent (a slow stretch lasts several steps), so steps are
resampled in blocks of neighbours, as long as the series. `traceml compare` reads the interval
of a change in median step time from it; the rules read the interval of a phase's share of the
step, so that a share sitting on a rule's line does not flip the verdict from run to run.
"""
from __future__ import annotations

import math
import random
from typing import List, Optional, Sequence, Tuple, TypeVar

CONFIDENCE = 0.95
MAX_POINTS = 1000  # steps a bootstrap resamples (evenly spaced when there are more)
SHARE_RESAMPLES = 400  # for a share's interval: the rules read it each time they run, live too

T = TypeVar("T")


def evenly(values: Sequence[T], max_points: int = MAX_POINTS) -> List[T]:
    """At most max_points of the values, evenly spaced."""
    if len(values) <= max_points:
        return list(values)
    stride = len(values) / max_points
    return [values[int(i * stride)] for i in range(max_points)]


def block_starts(count: int, rng: random.Random) -> Tuple[List[int], int]:
    """Where one resample's blocks start, and their length: blocks of about count^(1/3)
    neighbours, enough of them to cover `count` (the last one cut to fit)."""
    block = max(1, round(count ** (1 / 3)))
    return [rng.randrange(count - block + 1) for _ in range(-(-count // block))], block


def block_resample(values: List[float], rng: random.Random) -> List[float]:
    """A moving-block bootstrap sample of the values, as long as the series."""
    starts, block = block_starts(len(values), rng)
    sample: List[float] = []
    for start in starts:
        sample.extend(values[start:start + block])
    return sample[:len(values)]


# Student's t at the two-sided 95% level, by degrees of freedom (1 to 30); the normal's 1.96
# beyond. For the interval of a difference in means from a handful of runs, where a bootstrap
# over so few would be too narrow.
_STUDENT_T_95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
                 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
                 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_difference_half_width(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Half the CONFIDENCE interval of mean(b) - mean(a), the two samples' variance pooled
    (Student's t); None when there are fewer than three values in all, or CONFIDENCE is not 95%."""
    freedom = len(a) + len(b) - 2
    if freedom < 1 or not a or not b or CONFIDENCE != 0.95:
        return None
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    pooled = (sum((x - mean_a) ** 2 for x in a) + sum((x - mean_b) ** 2 for x in b)) / freedom
    t = _STUDENT_T_95[freedom - 1] if freedom <= len(_STUDENT_T_95) else 1.96
    return t * math.sqrt(pooled * (1 / len(a) + 1 / len(b)))


def interval(sorted_estimates: Sequence[float]) -> Tuple[float, float]:
    """The CONFIDENCE interval of sorted bootstrap estimates (percentile method)."""
    last = len(sorted_estimates) - 1
    tail = (1.0 - CONFIDENCE) / 2.0
    return sorted_estimates[int(tail * last)], sorted_estimates[int(math.ceil((1.0 - tail) * last))]


def share_interval(parts: Sequence[float], totals: Sequence[float], resamples: int = SHARE_RESAMPLES,
                   seed: int = 0) -> Tuple[float, float]:
    """The CONFIDENCE interval of sum(parts) / sum(totals) (a phase's share of the step), over
    steps resampled in blocks. Seeded: the same steps give the same interval. Its ends are
    rounded to 1e-6, so that steps all alike give their share itself, not a rounding of it."""
    parts, totals = evenly(parts), evenly(totals)
    count = len(parts)
    if count < 2:
        share = sum(parts) / sum(totals) if count and sum(totals) > 0 else 0.0
        return share, share
    rng = random.Random(seed)
    # Running sums: a block's sum is two lookups, so a resample costs its blocks, not its steps.
    part_sums, total_sums = [0.0], [0.0]
    for part, total in zip(parts, totals):
        part_sums.append(part_sums[-1] + part)
        total_sums.append(total_sums[-1] + total)
    shares = []
    for _ in range(resamples):
        starts, block = block_starts(count, rng)
        part = total = 0.0
        left = count
        for start in starts:
            end = start + min(block, left)
            part += part_sums[end] - part_sums[start]
            total += total_sums[end] - total_sums[start]
            left -= block
        shares.append(part / total if total > 0 else 0.0)
    low, high = interval(sorted(shares))
    return round(low, 6), round(high, 6)
