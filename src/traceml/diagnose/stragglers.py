"""Rules across ranks: which rank holds the others back, and why.

Under DDP the all-reduce inside backward makes every rank wait for the slowest, so wall-clock
step times look alike and the waiting lands on the healthy ranks. Each rank's collective wait
(comm_wait: from its last gradient bucket to backward's end) tells them apart: the straggler
is the rank that waits least, and what the others lose is how much longer they wait. Its own
figures against the other ranks' median then name the cause.
"""
from __future__ import annotations

import statistics
from typing import List, Optional

from traceml.analysis.rollup import RankRow
from traceml.records import Finding

LOSS_WARN_SHARE = 0.05  # the others lose this share of the step waiting: warn
LOSS_CRIT_SHARE = 0.20  # ... and this much: crit
CAUSE_SHARE = 0.5  # an excess that explains at least half the loss names the cause
BEHIND_SHARE = 0.75  # behind in this share of steps: a pattern, not the noise of a balanced run


def straggler(ranks: List[RankRow], step_ms: float) -> Optional[Finding]:
    """A straggler finding from per-rank medians (rollup.rank_medians), or None when balanced."""
    ranks = [r for r in ranks if r["steps"] and r["step_median_ms"] is not None]
    if len(ranks) < 2 or step_ms <= 0:
        return None
    if all(r["comm_wait_median_ms"] is not None for r in ranks):
        slow = min(ranks, key=lambda r: r["comm_wait_median_ms"])
        others = [r for r in ranks if r is not slow]
        loss_ms = _median(others, "comm_wait_median_ms") - slow["comm_wait_median_ms"]
        measured = "collective wait"
    else:
        # No collective timing (not DDP): a rank's own work is its
        # step without backward, where the waiting happens.
        own = {r["rank"]: r["step_median_ms"] - r["backward_median_ms"] for r in ranks}
        slow = max(ranks, key=lambda r: own[r["rank"]])
        others = [r for r in ranks if r is not slow]
        loss_ms = own[slow["rank"]] - statistics.median(own[r["rank"]] for r in others)
        measured = "own work outside backward"
    loss_share = loss_ms / step_ms
    if loss_share < LOSS_WARN_SHARE or slow["behind_share"] < BEHIND_SHARE:
        return None
    severity = "crit" if loss_share >= LOSS_CRIT_SHARE else "warn"
    rank = slow["rank"]

    input_excess = slow["input_wait_median_ms"] - _median(others, "input_wait_median_ms")
    compute = {r["rank"]: r["forward_median_ms"] + r["backward_median_ms"]
               - (r["comm_wait_median_ms"] or 0.0) for r in ranks}
    compute_excess = compute[rank] - statistics.median(compute[r["rank"]] for r in others)
    lost = (f"the other ranks wait {loss_ms:.1f} ms a step for it "
            f"({loss_share:.0%} of the {step_ms:.1f} ms step)")
    if input_excess >= CAUSE_SHARE * loss_ms:
        kind, value, median = "INPUT_STRAGGLER", slow["input_wait_median_ms"], _median(others, "input_wait_median_ms")
        summary = f"rank {rank} is slow to get its data: {lost}; its input wait is {value:.1f} ms against {median:.1f} ms on the others"
        action = (f"Look at rank {rank}'s input pipeline: its shard (larger or slower files, a "
                  "slower disk or network mount), per-sample work that varies by shard, too few "
                  "DataLoader workers for it. Balance the shards or raise num_workers.")
    elif compute_excess >= CAUSE_SHARE * loss_ms:
        kind, value, median = "COMPUTE_STRAGGLER", compute[rank], statistics.median(compute[r["rank"]] for r in others)
        summary = f"rank {rank} computes longer: {lost}; its forward and backward compute take {value:.1f} ms against {median:.1f} ms on the others"
        action = (f"Find what rank {rank} does more of: larger or longer samples (bucket batches "
                  "by length), extra work only on that rank (logging, metrics, evaluation), or a "
                  "slower or throttled device (check its clocks and temperature).")
    else:
        kind, value, median = "STRAGGLER", slow["step_median_ms"], _median(others, "step_median_ms")
        summary = f"rank {rank} holds the others back: {lost}; neither its input wait nor its compute explains it"
        action = (f"Compare rank {rank}'s time outside the step and untraced time with the others', "
                  "and its host: CPU contention, another process on its device, a slower link.")
    return Finding(kind=kind, severity=severity, summary=summary, action=action, rank=rank,
                   evidence={"rank_value_ms": round(value, 3), "others_median_ms": round(median, 3),
                             "loss_ms": round(loss_ms, 3), "share": round(loss_share, 4),
                             "behind_share": round(slow["behind_share"], 3),
                             "measured_by": measured, "ranks": len(ranks)})


def _median(ranks: List[RankRow], key: str) -> float:
    return statistics.median(r[key] for r in ranks)
