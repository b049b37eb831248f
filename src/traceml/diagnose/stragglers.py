"""Rules across ranks: which rank holds the others back, and why; and the wait for collectives
that no rank's lateness explains.

Under DDP the all-reduce inside backward makes every rank wait for the slowest, so wall-clock
step times look alike and the waiting lands on the healthy ranks. Each rank's collective wait
(comm_wait: from its last gradient bucket to backward's end) tells them apart: the straggler
is the rank that waits least, and what the others lose is how much longer they wait. Its own
figures against the other ranks' median then name the cause.
"""
from __future__ import annotations

import statistics
from typing import List, Mapping, Optional, Sequence, Tuple, Union

from traceml.analysis.rollup import RankRow, comm_wait_parts, rank_median_ms
from traceml.diagnose.spikes import OTHER_CPU_CORES
from traceml.records import STRAGGLER_KINDS, Finding, FindingKind, Severity, SystemSample
from traceml.words import rounded_parts

LOSS_WARN_SHARE = 0.05  # the others lose this share of the step waiting: warn
LOSS_CRIT_SHARE = 0.20  # ... and this much: crit
CAUSE_SHARE = 0.5  # an excess that explains at least half the loss names the cause
BEHIND_SHARE = 0.75  # behind in this share of steps: a pattern, not the noise of a balanced run
COMM_WARN_SHARE = 0.15  # even the least-waiting rank waits this share of the step in collectives: warn
COMM_CRIT_SHARE = 0.35
NODE_BUSY_SHARE = 0.9  # the node's CPUs this busy, other processes on OTHER_CPU_CORES of them: shared
CORES_OF_ITS_OWN = ("give each rank cores of its own: move other work off the machine, keep ranks x "
                    "threads (OMP_NUM_THREADS, DataLoader workers) within the cores, or pin each rank "
                    "to its own (taskset, numactl).")


def straggler(ranks: List[RankRow], step_ms: float, cores_taken: Optional[float] = None) -> Optional[Finding]:
    """A straggler finding from per-rank medians (rollup.rank_medians), or None when balanced.
    cores_taken: what other processes took of the ranks' node, all of its cores busy (see
    cores_taken_by_others; None: not known)."""
    ranks = [r for r in ranks if r["steps"] and r["step_median_ms"] is not None]
    if len(ranks) < 2 or step_ms <= 0:
        return None
    if all(r["comm_wait_median_ms"] is not None for r in ranks):
        slow = min(ranks, key=lambda r: _ms(r, "comm_wait_median_ms"))
        others = [r for r in ranks if r is not slow]
        loss_ms = _median(others, "comm_wait_median_ms") - _ms(slow, "comm_wait_median_ms")
        measured = "collective wait"
    else:
        # No collective timing (not DDP): a rank's own work is its
        # step without backward, where the waiting happens.
        own = {r["rank"]: _ms(r, "step_median_ms") - _ms(r, "backward_median_ms") for r in ranks}
        slow = max(ranks, key=lambda r: own[r["rank"]])
        others = [r for r in ranks if r is not slow]
        loss_ms = own[slow["rank"]] - statistics.median(own[r["rank"]] for r in others)
        measured = "own work outside backward"
    loss_share = loss_ms / step_ms
    if loss_share < LOSS_WARN_SHARE or slow["behind_share"] < BEHIND_SHARE:
        return None
    severity = Severity.CRIT if loss_share >= LOSS_CRIT_SHARE else Severity.WARN
    lost = (f"the other ranks wait {loss_ms:.1f} ms a step for it "
            f"({loss_share:.0%} of the {step_ms:.1f} ms step)")
    cpu_wait_excess = _excess_ms(slow, others, "cpu_wait_median_ms")
    on_cpu_excess = _excess_ms(slow, others, "on_cpu_median_ms")
    kind, value, median, summary, action = _cause(slow, others, loss_ms, step_ms, cpu_wait_excess, on_cpu_excess, lost)
    if kind == FindingKind.COMPUTE_STRAGGLER and cores_taken is not None and cores_taken >= OTHER_CPU_CORES:
        # A rank whose core is shared runs the same work slower, on a CPU (cache, frequency, the
        # sibling thread) as well as waiting for one: its time says it computed longer, not
        # that it had more to do.
        summary += (f"; other processes took {cores_taken:.1f} of this node's cores meanwhile, all of them "
                    "busy, and a rank that shares its core computes slower for the same work")
        action = (f"If the ranks do the same work, the machine is the cause: {CORES_OF_ITS_OWN} If not: "
                  + action[0].lower() + action[1:])
    return Finding(kind=kind, severity=severity, summary=summary, action=action, rank=slow["rank"],
                   evidence={"rank_value_ms": round(value, 3), "others_median_ms": round(median, 3),
                             "loss_ms": round(loss_ms, 3), "share": round(loss_share, 4),
                             "behind_share": round(slow["behind_share"], 3),
                             "cpu_wait_excess_ms": round(cpu_wait_excess, 3),
                             "on_cpu_excess_ms": round(on_cpu_excess, 3),
                             "other_processes_cores": None if cores_taken is None else round(cores_taken, 2),
                             "measured_by": measured, "ranks": len(ranks), "step_median_ms": round(step_ms, 3)})


def cores_taken_by_others(system: Sequence[SystemSample], start_unix_s: float, end_unix_s: float) -> Optional[float]:
    """The cores processes other than the training took while the steps between two moments ran,
    on a node whose CPUs were all busy (the median of the samples then); 0.0 where the node had
    cores to spare, None where no sample fell then."""
    samples = [s for s in system if s.cpu_count and start_unix_s <= s.unix_s <= end_unix_s + 1.0]  # a sample ends its second
    if not samples:
        return None
    if statistics.median(s.cpu_percent for s in samples) < NODE_BUSY_SHARE * 100:
        return 0.0
    return max(0.0, statistics.median(s.other_cores() for s in samples))


def _excess_ms(slow: RankRow, others: List[RankRow], key: str) -> float:
    """How much more of a figure of its training thread's (cpu_wait_median_ms: its wait for a CPU;
    on_cpu_median_ms: its time on one) the slow rank has than the others' median (0 where it is
    not known). A rank kept off the cores computes longer without doing more."""
    if any(rank_median_ms(r, key) is None for r in [slow, *others]):
        return 0.0
    return max(0.0, _ms(slow, key) - _median(others, key))


def _cause(slow: RankRow, others: List[RankRow], loss_ms: float, step_ms: float, cpu_wait_excess: float,
           on_cpu_excess: float, lost: str) -> Tuple[FindingKind, float, float, str, str]:
    """What makes the slow rank late: its kind, its figure and the others' median, and what to say
    and do."""
    rank = slow["rank"]
    input_excess = _ms(slow, "input_wait_median_ms") - _median(others, "input_wait_median_ms")
    compute = {r["rank"]: _ms(r, "forward_median_ms") + _ms(r, "backward_median_ms")
               - _ms(r, "comm_wait_median_ms") for r in [slow, *others]}
    compute_others_ms = statistics.median(compute[r["rank"]] for r in others)
    if input_excess >= CAUSE_SHARE * loss_ms:
        value, median = _ms(slow, "input_wait_median_ms"), _median(others, "input_wait_median_ms")
        return (FindingKind.INPUT_STRAGGLER, value, median,
                f"rank {rank} is slow to get its data: {lost}; its input wait is {value:.1f} ms against {median:.1f} ms on the others",
                f"Look at rank {rank}'s input pipeline: its shard (larger or slower files, a "
                "slower disk or network mount), per-sample work that varies by shard, too few "
                "DataLoader workers for it. Balance the shards or raise num_workers.")
    compute_excess = compute[rank] - compute_others_ms
    # The compute phases explain the loss. It is the rank's work when the work alone would still
    # hold the others back: its compute with its wait for a CPU set aside, or the longer time its
    # thread ran on a CPU. On a busy machine a rank with more work also waits longer (a thread
    # that runs long waits for a core more than one that mostly sleeps in its collectives), and
    # its wait spans the whole step, not its compute alone: the time it ran says what it did.
    # (On a GPU the host's time on a CPU is no measure of the device's work; the first holds.)
    work_excess = max(compute_excess - cpu_wait_excess, on_cpu_excess)
    if compute_excess >= CAUSE_SHARE * loss_ms and work_excess >= min(LOSS_WARN_SHARE * step_ms, CAUSE_SHARE * loss_ms):
        value, median = compute[rank], compute_others_ms
        return (FindingKind.COMPUTE_STRAGGLER, value, median,
                f"rank {rank} computes longer: {lost}; its forward and backward compute take {value:.1f} ms against {median:.1f} ms on the others",
                f"Find what rank {rank} does more of: larger or longer samples (bucket batches "
                "by length), extra work only on that rank (logging, metrics, evaluation), or a "
                "slower or throttled device (check its clocks and temperature).")
    if max(compute_excess, cpu_wait_excess) >= CAUSE_SHARE * loss_ms:
        value, median = _ms(slow, "cpu_wait_median_ms"), _median(others, "cpu_wait_median_ms")
        return (FindingKind.STRAGGLER, value, median,
                f"rank {rank} waits for a CPU: {lost}; its training thread is ready to run but waits "
                f"{value:.1f} ms a step for a core, against {median:.1f} ms on the others",
                f"Other processes, or too many threads, hold the cores rank {rank} runs on: {CORES_OF_ITS_OWN}")
    return (FindingKind.STRAGGLER, _ms(slow, "step_median_ms"), _median(others, "step_median_ms"),
            f"rank {rank} holds the others back: {lost}; neither its input wait nor its compute explains it",
            f"Compare rank {rank}'s time outside the step and untraced time with the others', "
            "and its host: CPU contention, another process on its device, a slower link.")


def _ms(row: RankRow, key: str) -> float:
    """A median the rule has checked is measured on every rank it reads (a None reads as 0.0)."""
    return rank_median_ms(row, key) or 0.0


def _median(ranks: List[RankRow], key: str) -> float:
    return float(statistics.median(_ms(r, key) for r in ranks))


FSDP_COMM_ACTION = (
    "Overlap the collectives with compute: prefetch the next unit's all-gather (FSDP2: "
    "set_modules_to_forward_prefetch and set_modules_to_backward_prefetch; FSDP1: forward_prefetch=True, "
    "backward_prefetch=BACKWARD_PRE). For a model that fits, reshard_after_forward=False skips the "
    "all-gathers in backward. Wrap fewer, larger units (each collective has a fixed cost), give each step "
    "more compute per byte moved (a larger batch per rank), and across nodes shard within a node and "
    "replicate across them (HSDP).")
ZERO_COMM_ACTION = (
    "Overlap the reductions with backward (zero_optimization.overlap_comm: true, with "
    "contiguous_gradients), and make each collective larger and fewer: reduce_bucket_size and "
    "allgather_bucket_size. Give each step more compute per byte moved: a larger micro-batch, or more "
    "gradient_accumulation_steps (the updated partitions are all-gathered once per optimizer step). "
    "Across nodes, keep the data-parallel group within a node where the model fits (ZeRO++ hpZ).")
DDP_COMM_ACTION = (
    "Give the all-reduce more compute to hide behind: a larger batch per rank, or gradient accumulation "
    "under no_sync() so that only the last micro-batch reduces. Tune bucket_cap_mb (fewer, larger "
    "buckets cost less each), and try static_graph=True or a compression hook (bf16) for large models.")


def comm_bound(ranks: List[RankRow], step_ms: float, sharded_by: str = "") -> Optional[Finding]:
    """The wait for collectives no rank's lateness explains is a large share of the step: the
    least-waiting rank's wait is the collectives' own cost (the others wait for it, besides).
    From per-rank medians where every rank measured it (DDP; FSDP and DeepSpeed on the CPU).
    sharded_by: what shards the model ("FSDP2", "DeepSpeed ZeRO-2"; "": DDP or unknown), for
    what to try."""
    ranks = [r for r in ranks if r["steps"] and r["comm_wait_median_ms"] is not None]
    if len(ranks) < 2 or step_ms <= 0:
        return None
    least = min(ranks, key=lambda r: _ms(r, "comm_wait_median_ms"))
    exposed_ms = _ms(least, "comm_wait_median_ms")
    share = exposed_ms / step_ms
    if share < COMM_WARN_SHARE:
        return None
    parts_ms = comm_wait_parts(least)
    forward_ms, backward_ms, optimizer_ms = parts_ms["forward"], parts_ms["backward"], parts_ms["optimizer"]
    # FSDP all-gathers before forward; DDP's all-reduce is in backward alone.
    zero = sharded_by.startswith("DeepSpeed")
    sharded = bool(sharded_by) or forward_ms > 0
    if sharded:
        # In tenths of a millisecond that add up to the wait said.
        tenths = rounded_parts([forward_ms, backward_ms, optimizer_ms], 1)
        parts = zip(tenths, ("in forward's all-gathers", "in backward", "in the optimizer step's all-gathers"))
        where = ", ".join(f"{ms:.1f} ms {place}" for ms, place in parts if ms > 0.05) or "in backward"
    else:
        where = "in backward's all-reduce, after the last gradient bucket"
    measured_by = sharded_by or ("FSDP" if sharded else "DDP")
    return Finding(
        kind=FindingKind.COMM_BOUND, severity=Severity.CRIT if share >= COMM_CRIT_SHARE else Severity.WARN,
        summary=(f"the step waits {exposed_ms:.1f} ms for collectives ({share:.0%} of the {step_ms:.1f} ms step) "
                 f"even on rank {least['rank']}, the one that waits least: {where}; no rank's lateness explains it"),
        action=ZERO_COMM_ACTION if zero else FSDP_COMM_ACTION if sharded else DDP_COMM_ACTION,
        rank=None,
        evidence={"share": round(share, 4), "comm_wait_ms": round(exposed_ms, 3),
                  "forward_comm_wait_ms": round(forward_ms, 3),
                  "backward_comm_wait_ms": round(backward_ms, 3), "optimizer_comm_wait_ms": round(optimizer_ms, 3),
                  "step_median_ms": round(step_ms, 3), "least_waiting_rank": least["rank"],
                  "ranks": len(ranks), "measured_by": f"{measured_by} collectives" if sharded else "DDP all-reduce"})


# A finding as the rules return it, or as final_summary.json keeps it (a dict).
FindingOrDict = Union[Finding, Mapping[str, object]]


def straggler_finding(findings: Sequence[FindingOrDict]) -> Optional[FindingOrDict]:
    """The straggler finding (INPUT_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER), or None."""
    for finding in findings:
        kind = finding.kind if isinstance(finding, Finding) else finding.get("kind")
        if kind in STRAGGLER_KINDS:
            return finding
    return None


def straggler_rank(findings: Sequence[FindingOrDict]) -> Optional[int]:
    """The rank a straggler finding names (the rank tables mark it), or None."""
    finding = straggler_finding(findings)
    if finding is None:
        return None
    rank = finding.rank if isinstance(finding, Finding) else finding.get("rank")
    return rank if isinstance(rank, int) else None
