"""The straggler and COMM_BOUND rules on synthetic per-rank medians, and the live rollup across ranks."""
import pytest

from traceml.analysis.rollup import LiveRollup, rank_medians
from traceml.diagnose.stragglers import (BEHIND_SHARE, COMM_CRIT_SHARE, COMM_WARN_SHARE, LOSS_CRIT_SHARE,
                                         LOSS_WARN_SHARE, comm_bound, cores_taken_by_others, straggler)
from traceml.records import SystemSample
from test_records import step


def rank_row(rank, comm_wait=2.0, input_wait=0.5, forward=3.0, backward=8.0, behind=0.5, step_ms=20.0,
             forward_comm_wait=0.0, cpu_wait=None, on_cpu=None):
    return {"rank": rank, "steps": 50, "last_step": 59, "step_median_ms": step_ms, "behind_share": behind,
            "input_wait_median_ms": input_wait, "forward_median_ms": forward,
            "backward_median_ms": backward, "comm_wait_median_ms": comm_wait,
            "forward_comm_wait_median_ms": forward_comm_wait, "cpu_wait_median_ms": cpu_wait,
            "on_cpu_median_ms": on_cpu}


def test_balanced_ranks_give_no_finding():
    assert straggler([rank_row(0), rank_row(1), rank_row(2)], step_ms=20.0) is None


def test_input_straggler_is_the_rank_that_waits_least():
    ranks = [rank_row(0, comm_wait=10.0), rank_row(1, comm_wait=1.0, input_wait=9.5, behind=0.9),
             rank_row(2, comm_wait=10.2)]
    found = straggler(ranks, step_ms=20.0)
    assert (found.kind, found.rank, found.severity) == ("INPUT_STRAGGLER", 1, "crit")
    assert found.evidence["loss_ms"] == pytest.approx(9.1)  # the others' median wait, 10.1, less 1.0
    assert found.evidence["share"] == pytest.approx(0.455)
    assert found.evidence["rank_value_ms"] == 9.5 and found.evidence["others_median_ms"] == 0.5
    assert "rank 1" in found.summary and "9.1 ms a step" in found.summary


def test_compute_straggler_from_own_forward_and_backward_compute():
    ranks = [rank_row(0, comm_wait=6.0), rank_row(1, comm_wait=1.0, forward=8.0, behind=1.0)]
    found = straggler(ranks, step_ms=20.0)
    assert (found.kind, found.rank) == ("COMPUTE_STRAGGLER", 1)


def test_a_compute_lead_that_is_the_ranks_wait_for_a_cpu_names_the_wait():
    # Rank 1 computes 5 ms longer (forward and backward less its collective wait: 10 ms against
    # 5), and its thread waited 4.5 ms longer for a core: the scheduler gave that time to other
    # processes; it did no more work than rank 0.
    ranks = [rank_row(0, comm_wait=6.0, cpu_wait=0.3), rank_row(1, comm_wait=1.0, behind=1.0, cpu_wait=4.8)]
    found = straggler(ranks, step_ms=20.0)
    assert (found.kind, found.rank) == ("STRAGGLER", 1)
    assert "rank 1 waits for a CPU" in found.summary and "4.8 ms a step for a core, against 0.3 ms" in found.summary
    assert found.evidence["cpu_wait_excess_ms"] == 4.5
    assert "cores of its own" in found.action


def test_a_compute_lead_beyond_the_ranks_wait_for_a_cpu_is_still_its_compute():
    # On a busy machine rank 1 computes 5 ms longer and waits 2 ms longer for a core: 3 ms of
    # work more than rank 0, over half of the 5 ms the others lose.
    ranks = [rank_row(0, comm_wait=6.0, cpu_wait=1.0), rank_row(1, comm_wait=1.0, behind=1.0, cpu_wait=3.0)]
    found = straggler(ranks, step_ms=20.0)
    assert (found.kind, found.rank) == ("COMPUTE_STRAGGLER", 1)
    assert found.evidence["cpu_wait_excess_ms"] == 2.0


def test_a_rank_doing_more_work_on_a_busy_machine_waits_longer_and_is_still_a_compute_straggler():
    # Seen in the suite: rank 1 spins 10 ms of CPU a step on a loaded machine and waits 13.4 ms
    # longer for cores than rank 0, which mostly sleeps in its all-reduce and hardly waits. The
    # wait is the larger part of its 22.7 ms lead, yet its 9.3 ms of work alone would hold the
    # others back: the work is the cause.
    ranks = [dict(rank_row(0, comm_wait=25.14, input_wait=0.17, forward=0.32, backward=25.8, step_ms=26.73,
                           cpu_wait=0.19), behind_share=0.0),
             rank_row(1, comm_wait=2.19, input_wait=0.13, forward=23.08, backward=2.81, step_ms=27.53, behind=1.0,
                      cpu_wait=13.63)]
    found = straggler(ranks, step_ms=27.1)
    assert (found.kind, found.rank) == ("COMPUTE_STRAGGLER", 1)
    assert found.evidence["cpu_wait_excess_ms"] == 13.44


def test_a_rank_whose_longer_wait_outgrows_its_compute_lead_is_a_compute_straggler_by_its_time_on_a_cpu():
    # Seen in the suite beside five workers on two cores (FSDP2): rank 1 spins 30 ms of CPU a
    # step and its thread, ready to run, waits 127 ms a step for a core. That wait spans its
    # whole step and outgrows its 88 ms compute lead. Its thread ran about 30 ms longer on a
    # CPU (its spin; that run kept no time on a CPU, so these two are what it would have),
    # which no wait makes: the work is the cause.
    ranks = [dict(rank_row(0, comm_wait=188.37, input_wait=0.0, forward=141.55, backward=60.22, step_ms=201.88,
                           forward_comm_wait=136.34, cpu_wait=0.73, on_cpu=21.0), behind_share=0.0),
             rank_row(1, comm_wait=92.52, input_wait=0.0, forward=131.02, backward=62.66, step_ms=202.08, behind=1.0,
                      forward_comm_wait=35.4, cpu_wait=127.26, on_cpu=52.0)]
    found = straggler(ranks, step_ms=202.4)
    assert (found.kind, found.rank) == ("COMPUTE_STRAGGLER", 1)
    assert found.evidence["on_cpu_excess_ms"] == 31.0 and found.evidence["cpu_wait_excess_ms"] == 126.53
    # The same waits with the same time on a CPU: the machine's, not the rank's work.
    ranks[1]["on_cpu_median_ms"] = 21.5
    assert "rank 1 waits for a CPU" in straggler(ranks, step_ms=202.4).summary


def test_a_compute_straggler_on_a_node_other_processes_keep_busy_says_the_machine_may_be_the_cause():
    # Seen beside a busy loop and another test's process: two ranks with the same work, one of
    # them 2.3 ms against 0.7 ms in forward and backward, its wait for a CPU and its time on one
    # longer too. Its time says it computed longer, not that it had more to do.
    ranks = [rank_row(0, comm_wait=2.36, forward=0.2, backward=2.86, behind=0.1, cpu_wait=0.04, on_cpu=1.0),
             rank_row(1, comm_wait=0.6, forward=0.32, backward=2.56, behind=0.9, cpu_wait=0.74, on_cpu=1.4)]
    shared = straggler(ranks, step_ms=3.4, cores_taken=1.8)
    assert (shared.kind, shared.rank) == ("COMPUTE_STRAGGLER", 1)
    assert "other processes took 1.8 of this node's cores meanwhile" in shared.summary
    assert shared.action.startswith("If the ranks do the same work, the machine is the cause: give each rank cores")
    assert "find what rank 1 does more of" in shared.action and shared.evidence["other_processes_cores"] == 1.8
    for spare in (0.0, 0.3, None):  # cores to spare, a little taken, or not known: the rank's work
        alone = straggler(ranks, step_ms=3.4, cores_taken=spare)
        assert "other processes" not in alone.summary and alone.action.startswith("Find what rank 1 does more of")


def test_what_other_processes_take_counts_only_on_a_node_whose_cores_are_all_busy():
    def sample(unix_s, machine_percent, training_percent):
        return SystemSample(unix_s, machine_percent, 0, 1, training_percent, 0, cpu_count=2)

    busy = [sample(t, 98.0, 110.0) for t in (10.0, 11.0, 12.0)]  # 1.96 cores busy, 1.1 of them training
    assert cores_taken_by_others(busy, 10.0, 11.5) == pytest.approx(0.86)
    spare = [sample(t, 60.0, 110.0) for t in (10.0, 11.0)]  # 1.2 cores busy: the ranks have room
    assert cores_taken_by_others(spare, 10.0, 11.0) == 0.0
    later = [sample(10.0, 50.0, 90.0), sample(30.0, 98.0, 110.0), sample(31.0, 98.0, 110.0)]
    assert cores_taken_by_others(later, 29.5, 31.0) == pytest.approx(0.86)  # the steps' own seconds
    assert cores_taken_by_others(later, 20.0, 25.0) is None  # none then: not the start's, nor the end's
    assert cores_taken_by_others([], 0.0, 1.0) is None


def test_unexplained_straggler():
    # Same input wait, same own compute (backward less its wait: 2 ms on both), yet behind.
    ranks = [rank_row(0, comm_wait=6.0), rank_row(1, comm_wait=1.0, backward=3.0, behind=1.0)]
    found = straggler(ranks, step_ms=20.0)
    assert (found.kind, found.rank) == ("STRAGGLER", 1)


@pytest.mark.parametrize("loss_ms,severity", [
    (LOSS_WARN_SHARE * 20.0 - 0.01, None), (LOSS_WARN_SHARE * 20.0, "warn"),
    (LOSS_CRIT_SHARE * 20.0 - 0.01, "warn"), (LOSS_CRIT_SHARE * 20.0, "crit")])
def test_severity_scales_with_what_the_others_lose(loss_ms, severity):
    ranks = [rank_row(0, comm_wait=1.0 + loss_ms), rank_row(1, comm_wait=1.0, input_wait=0.5 + loss_ms, behind=1.0)]
    found = straggler(ranks, step_ms=20.0)
    assert (found.severity if found else None) == severity


def test_a_rank_behind_only_by_chance_is_not_a_straggler():
    ranks = [rank_row(0, comm_wait=6.0), rank_row(1, comm_wait=1.0, input_wait=5.5, behind=BEHIND_SHARE - 0.01)]
    assert straggler(ranks, step_ms=20.0) is None


def test_without_collective_timing_own_work_outside_backward_decides():
    ranks = [rank_row(0, comm_wait=None, input_wait=0.5), rank_row(1, comm_wait=None, input_wait=6.5, step_ms=26.0, behind=1.0)]
    found = straggler(ranks, step_ms=26.0)
    assert (found.kind, found.rank) == ("INPUT_STRAGGLER", 1)
    assert found.evidence["measured_by"] == "own work outside backward"


def test_fsdp_ranks_waiting_alike_in_their_collectives_are_comm_bound():
    # Both ranks wait 9-10 ms of a 20 ms step, 6 of them in forward's all-gathers: no rank is
    # late, so the least wait (9 ms) is the collectives' own cost.
    ranks = [rank_row(0, comm_wait=9.0, forward=10.0, forward_comm_wait=6.0),
             rank_row(1, comm_wait=10.0, forward=10.5, forward_comm_wait=6.5)]
    assert straggler(ranks, step_ms=20.0) is None
    found = comm_bound(ranks, step_ms=20.0)
    assert (found.kind, found.severity, found.rank) == ("COMM_BOUND", "crit", None)
    assert found.evidence["comm_wait_ms"] == 9.0 and found.evidence["share"] == 0.45
    assert (found.evidence["forward_comm_wait_ms"], found.evidence["backward_comm_wait_ms"]) == (6.0, 3.0)
    assert "6.0 ms in forward's all-gathers, 3.0 ms in backward" in found.summary
    assert "set_modules_to_forward_prefetch" in found.action and "reshard_after_forward=False" in found.action


def test_under_ddp_the_advice_is_the_all_reduces():
    found = comm_bound([rank_row(0, comm_wait=5.0), rank_row(1, comm_wait=6.0)], step_ms=20.0)
    assert found.kind == "COMM_BOUND" and "all-reduce" in found.summary and "bucket_cap_mb" in found.action


@pytest.mark.parametrize("least_ms,severity", [
    (COMM_WARN_SHARE * 20.0 - 0.01, None), (COMM_WARN_SHARE * 20.0, "warn"),
    (COMM_CRIT_SHARE * 20.0 - 0.01, "warn"), (COMM_CRIT_SHARE * 20.0, "crit")])
def test_comm_bound_counts_the_least_waiting_ranks_wait(least_ms, severity):
    # A straggler's lateness shows as the others' wait; only what even the late rank waits is the wire's.
    ranks = [rank_row(0, comm_wait=least_ms + 8.0), rank_row(1, comm_wait=least_ms, behind=1.0)]
    found = comm_bound(ranks, step_ms=20.0)
    assert (found.severity if found else None) == severity


def test_no_comm_bound_without_collective_timing_or_with_one_rank():
    assert comm_bound([rank_row(0, comm_wait=None), rank_row(1, comm_wait=None)], step_ms=20.0) is None
    assert comm_bound([rank_row(0, comm_wait=15.0)], step_ms=20.0) is None


def records_for(rank, steps, comm_wait):
    out = []
    for index in range(steps):
        record = step(index)
        record.rank, record.comm_wait_ms = rank, comm_wait
        out.append(record)
    return out


def test_rank_medians_count_how_often_each_rank_was_waited_for():
    records = records_for(0, 20, comm_wait=5.0) + records_for(1, 20, comm_wait=1.0)
    rows = rank_medians(records, skip_steps=2)
    assert [(r["rank"], r["steps"], r["behind_share"]) for r in rows] == [(0, 18, 0.0), (1, 18, 1.0)]
    assert rows[1]["comm_wait_median_ms"] == 1.0 and rows[1]["last_step"] == 19


def test_live_rollup_rolls_a_step_once_every_rank_reported_it():
    live = LiveRollup(keep_steps=10, stale_after=5)
    live.world_size = 2
    live.add(records_for(0, 3, comm_wait=1.0))
    assert len(live.recent) == 0 and live.pending_steps == 3
    live.add(records_for(1, 3, comm_wait=1.0))
    assert [s.step for s in live.recent] == [0, 1, 2] and all(s.ranks == 2 for s in live.recent)


def test_live_rollup_does_not_wait_forever_for_a_dead_rank_and_stays_bounded():
    live = LiveRollup(keep_steps=10, stale_after=5, stale_s=0.0)
    live.world_size = 2
    live.add(records_for(0, 40, comm_wait=1.0))  # rank 1 never reports
    assert live.pending_steps == 5  # only the last few wait for it
    assert len(live.recent) == 10 and live.recent[-1].step == 34 and live.recent[-1].ranks == 1


def test_live_rollup_waits_a_moment_for_a_rank_whose_frame_is_still_coming():
    # Fast steps: one rank's frame runs far ahead of another's (each sends every 100 ms).
    live = LiveRollup(keep_steps=100, stale_after=5, stale_s=60.0)
    live.world_size = 2
    live.add(records_for(0, 40, comm_wait=1.0))
    assert live.pending_steps == 40 and not live.recent  # not stale yet: too young
    live.add(records_for(1, 40, comm_wait=1.0))
    assert len(live.recent) == 40 and all(s.ranks == 2 for s in live.recent) and not live.late_steps
