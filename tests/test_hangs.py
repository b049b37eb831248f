"""The hang locator: a rank that ends no step is named with its line within seconds, live (stderr,
/metrics) and in the summary the run ends with; planned work and a slow step are no hang."""
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import psutil
import pytest
from conftest import SCRIPTS, _env, ended_well

from traceml.diagnose.hangs import HANG_AFTER_S, RankProgress, allowance_s, find_hang, rank_lost
from traceml.records import RankEnd, RankHello, RankPulse

HANG_LOOP = SCRIPTS / "hang_loop.py"


# -- the rule, on what the collector would hold --------------------------------------------------
def progress(rank, steps=20, stalled_s=0.0, pulse=None, now=1000.0, **kwargs):
    return RankProgress(rank=rank, pid=100 + rank, host="elsewhere", steps_ended=steps,
                        last_progress_unix_s=now - stalled_s, median_step_ms=10.0,
                        last_heard_unix_s=now - 1.0, pulse=pulse, **kwargs)


def pulse(rank, stalled_s, steps=20, phase="backward", waiting_in="", stack=(("/home/me/train.py", 42, "load"),),
          now=1000.0, innermost="time.py:1 sleep", **kwargs):
    return RankPulse(rank=rank, unix_s=now - 1.0, steps_ended=steps, since_progress_s=stalled_s - 1.0,
                     phase=phase, stack=list(stack), innermost=innermost, waiting_in=waiting_in,
                     pid=100 + rank, **kwargs)


def test_the_rank_in_its_own_code_is_named_and_the_waiting_one_told_apart():
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce",
                                                                 stack=[("/home/me/train.py", 50, "main")])),
                      progress(1, stalled_s=40, pulse=pulse(1, 40, phase="in step"))], 1000.0)
    assert hang.finding.kind == "HANG" and hang.finding.rank == 1 and hang.stalled_ranks == [0, 1]
    assert "rank 1 is in its own code at train.py:42 load" in hang.finding.summary
    assert "rank 0 waits in all_reduce from backward at train.py:50 main for 40 s" in hang.finding.summary
    assert "py-spy dump --pid 101" in hang.finding.action


def test_within_the_allowance_evaluation_and_a_first_step_are_no_hang():
    assert find_hang([progress(0, stalled_s=HANG_AFTER_S - 1)], 1000.0) is None
    assert find_hang([progress(0, stalled_s=60, pulse=pulse(0, 60, phase="evaluation"))], 1000.0) is None
    assert find_hang([progress(0, stalled_s=60, pulse=pulse(0, 60, phase="checkpoint"))], 1000.0) is None
    assert find_hang([progress(0, steps=0, stalled_s=300)], 1000.0) is None  # loading, a first compile
    slow = progress(0, stalled_s=60)
    slow.median_step_ms = 8000.0  # 8 s steps: 80 s allowed
    assert allowance_s(slow, HANG_AFTER_S) == 80.0 and find_hang([slow], 1000.0) is None


def test_a_gone_rank_and_a_frozen_one_are_said_so():
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce")),
                      progress(1, stalled_s=40, gone=True)], 1000.0)
    assert hang.finding.rank == 1 and "rank 1 is gone (pid 101" in hang.finding.summary
    frozen = progress(1, stalled_s=40)
    frozen.last_heard_unix_s = 1000.0 - 30
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce")), frozen], 1000.0)
    assert "rank 1 no longer answers (pid 101" in hang.finding.summary


def test_every_rank_in_a_collective_is_a_mismatch():
    hang = find_hang([progress(r, stalled_s=40, pulse=pulse(r, 40, waiting_in="all_reduce")) for r in (0, 1)],
                     1000.0)
    assert hang.finding.rank is None and "called different ones" in hang.finding.summary
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in hang.finding.action


def test_counts_of_collectives_say_which_rank_is_behind():
    ranks = [progress(r, stalled_s=40, pulse=pulse(r, 40, waiting_in="all_reduce", collectives_issued=41))
             for r in (0, 2)]
    ranks.insert(1, progress(1, stalled_s=40, pulse=pulse(1, 40, waiting_in="barrier", collectives_issued=39)))
    hang = find_hang(ranks, 1000.0)
    assert "rank 1 has issued 2 collectives fewer than ranks 0, 2 (39 against 41)" in hang.finding.summary
    assert "called different ones" not in hang.finding.summary  # the counts say it better
    assert [place["collectives_issued"] for place in hang.ranks] == [41, 39, 41]
    same = [progress(r, stalled_s=40, pulse=pulse(r, 40, waiting_in="all_reduce", collectives_issued=7))
            for r in (0, 1)]
    assert "collectives fewer" not in find_hang(same, 1000.0).finding.summary
    # Rank 1, behind, waits in a collective itself: it is the one named, as one that skipped one.
    assert hang.finding.rank == 1 and hang.finding.summary.startswith("no step has ended for 40 s on ranks 0, 1, 2: "
                                                                       "rank 1 waits in barrier")
    assert hang.finding.action.startswith("Look at rank 1's train.py:42 load: it has issued fewer collectives")
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in hang.finding.action


def test_on_a_2d_mesh_the_counts_of_each_dimension_chain_to_the_rank_that_has_not_arrived():
    # DP over "ranks 0, 2" and "ranks 1, 3" (DDP's all-reduce from C++: no group said), TP over
    # "ranks 0, 1" and "ranks 2, 3". Rank 2 stalls in its own code before its TP all-reduce: rank 3
    # waits for it there; ranks 0 and 1 went on to backward, where rank 1 waits on rank 3 (behind
    # on their DP group, yet ahead on its TP group) and rank 0 on rank 2. The default group's
    # counts agree and say nothing.
    def mesh_pulse(rank, dp, tp, **kwargs):
        return pulse(rank, 40, collectives_issued=3, subgroup_collectives={
            f"ranks {rank % 2}, {rank % 2 + 2}": dp, f"ranks {rank - rank % 2}, {rank - rank % 2 + 1}": tp}, **kwargs)

    stuck = mesh_pulse(2, dp=20, tp=30, phase="forward", stack=[("/home/me/train.py", 7, "wait_for_shard")])
    tp_wait = mesh_pulse(3, dp=20, tp=31, phase="forward", waiting_in="all_reduce", waiting_group="ranks 2, 3",
                         stack=[("/home/me/train.py", 20, "forward")])
    ddp_wait = dict(phase="backward", stack=[("/home/me/train.py", 11, "main")],
                    innermost="graph.py:829 _engine_run_backward")
    hang = find_hang([progress(0, stalled_s=40, pulse=mesh_pulse(0, dp=21, tp=31, **ddp_wait)),
                      progress(1, stalled_s=40, pulse=mesh_pulse(1, dp=21, tp=31, **ddp_wait)),
                      progress(2, stalled_s=40, pulse=stuck), progress(3, stalled_s=40, pulse=tp_wait)], 1000.0)
    assert hang.finding.rank == 2
    assert [(p["state"], p["waiting_in"]) for p in hang.ranks] == [
        ("collective", "DDP's all_reduce"), ("collective", "DDP's all_reduce"), ("own code", None),
        ("collective", "all_reduce")]
    assert hang.finding.summary.startswith("no step has ended for 40 s on ranks 0, 1, 2, 3: rank 2 is in its own "
                                           "code at train.py:7 wait_for_shard (forward)")
    assert hang.finding.summary.endswith("rank 2 has issued 1 collective fewer than rank 3 on the group of "
                                         "ranks 2, 3 (30 against 31)")
    assert hang.finding.evidence["decided_on_group"] == "ranks 2, 3"


def test_mismatched_calls_on_groups_name_the_rank_behind_where_the_others_wait():
    # Each rank is ahead on one group and behind on another: no chain ends. The group the
    # waiting ranks wait on decides.
    hang = find_hang([
        progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce", waiting_group="ranks 0, 1",
                                              collectives_issued=9, subgroup_collectives={"ranks 0, 1": 8})),
        progress(1, stalled_s=40, pulse=pulse(1, 40, waiting_in="all_reduce", waiting_group="ranks 0, 1",
                                              collectives_issued=10, subgroup_collectives={"ranks 0, 1": 7})),
        progress(2, stalled_s=40, pulse=pulse(2, 40, waiting_in="barrier", waiting_group="world",
                                              collectives_issued=10))], 1000.0)
    assert hang.finding.rank == 1 and "rank 1 has issued 1 collective fewer than rank 0 on the group of ranks 0, 1 " \
        "(7 against 8)" in hang.finding.summary


def ddp_backward_pulse(rank, collectives_issued, stalled_s=40):
    """Blocked in backward, in the autograd engine, where DDP's reducer waits for its all-reduce
    in C++: the innermost frame is autograd's, the user's innermost is the backward() call."""
    return pulse(rank, stalled_s, phase="backward", stack=[("/home/me/train.py", 11, "main")],
                 innermost="graph.py:829 _engine_run_backward", collectives_issued=collectives_issued)


def test_under_ddp_the_rank_behind_on_the_counts_is_named_and_the_one_in_backward_waits():
    # The case: rank 1 stalls in its own code before forward; rank 0 went on to backward,
    # issued its gradient all-reduce (one collective more) and waits in it, inside autograd.
    stuck = pulse(1, 39, phase="in step", stack=[("/home/me/train.py", 7, "wait_for_shard"),
                                                 ("/home/me/train.py", 10, "main")], collectives_issued=20)
    hang = find_hang([progress(0, stalled_s=40, pulse=ddp_backward_pulse(0, 21)),
                      progress(1, stalled_s=39, pulse=stuck)], 1000.0)
    assert hang.finding.rank == 1 and hang.finding.evidence["culprit_rank"] == 1
    assert hang.finding.summary == (
        "no step has ended for 40 s on ranks 0, 1: rank 1 is in its own code at train.py:7 wait_for_shard "
        "(in step); rank 0 waits in DDP's all_reduce from backward at train.py:11 main for "
        "40 s; rank 1 has issued 1 collective fewer than rank 0 (20 against 21)")
    assert hang.finding.action.startswith("Look at rank 1's train.py:7 wait_for_shard: the other ranks wait")
    assert "py-spy dump --pid 101" in hang.finding.action
    assert hang.finding.evidence["where"] == "train.py:7 wait_for_shard"
    assert [(p["state"], p["waiting_in"]) for p in hang.ranks] == [("collective", "DDP's all_reduce"),
                                                                   ("own code", None)]
    # Its stall in the optimizer or a layer's forward reads the same; so does rank 0 as the culprit.
    hang = find_hang([progress(0, stalled_s=39, pulse=pulse(0, 39, phase="optimizer", collectives_issued=20)),
                      progress(1, stalled_s=40, pulse=ddp_backward_pulse(1, 21))], 1000.0)
    assert hang.finding.rank == 0 and hang.finding.summary.startswith(
        "no step has ended for 40 s on ranks 0, 1: rank 0 is in its own code at train.py:42 load (optimizer); "
        "rank 1 waits in DDP's all_reduce from backward at train.py:11 main")


def test_the_counts_decide_before_the_stacks():
    # Both in their own code by their stacks: the one with fewer collectives issued is named,
    # though listed second; the other, ahead but not in backward, stays in its own code.
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, phase="optimizer", collectives_issued=21)),
                      progress(1, stalled_s=40, pulse=pulse(1, 40, phase="forward", collectives_issued=20))], 1000.0)
    assert hang.finding.rank == 1 and [p["state"] for p in hang.ranks] == ["own code", "own code"]
    assert hang.finding.summary.startswith("no step has ended for 40 s on ranks 0, 1: rank 1 is in its own code")
    # In backward, ahead, but its own frame innermost (a hook of its own that stalls): its own code.
    hook = pulse(0, 40, stack=[("/home/me/train.py", 30, "clip_hook")], innermost="train.py:30 clip_hook",
                 collectives_issued=21)
    hang = find_hang([progress(0, stalled_s=40, pulse=hook),
                      progress(1, stalled_s=40, pulse=pulse(1, 40, phase="forward", collectives_issued=20))], 1000.0)
    assert hang.finding.rank == 1 and [p["state"] for p in hang.ranks] == ["own code", "own code"]
    # Without counts that differ, backward is no collective: the stacks decide, the first absent rank.
    hang = find_hang([progress(0, stalled_s=40, pulse=ddp_backward_pulse(0, 21)),
                      progress(1, stalled_s=40, pulse=pulse(1, 40, phase="forward", collectives_issued=-1))], 1000.0)
    assert hang.finding.rank == 0 and hang.ranks[0]["state"] == "own code"
    # Two ranks behind, one waiting and one absent: the absent one is named.
    ranks = [progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce", collectives_issued=41)),
             progress(1, stalled_s=40, pulse=pulse(1, 40, waiting_in="barrier", collectives_issued=40)),
             progress(2, stalled_s=40, pulse=pulse(2, 40, phase="forward", collectives_issued=40))]
    assert find_hang(ranks, 1000.0).finding.rank == 2
    # A rank gone or frozen carries no count: the others agreeing, it is named, and they wait.
    hang = find_hang([progress(0, stalled_s=40, pulse=ddp_backward_pulse(0, 21)),
                      progress(1, stalled_s=40, pulse=ddp_backward_pulse(1, 21)),
                      progress(2, stalled_s=40, gone=True)], 1000.0)
    assert hang.finding.rank == 2 and hang.finding.summary.startswith(
        "no step has ended for 40 s on ranks 0, 1, 2: rank 2 is gone (pid 102")
    assert [p["state"] for p in hang.ranks] == ["collective", "collective", "gone"]
    frozen = progress(1, stalled_s=40)
    frozen.last_heard_unix_s = 1000.0 - 30
    hang = find_hang([progress(0, stalled_s=40, pulse=ddp_backward_pulse(0, 21)), frozen], 1000.0)
    assert hang.finding.rank == 1 and "rank 0 waits in DDP's all_reduce from backward" in hang.finding.summary


def test_a_dataloader_wait_names_the_worker_that_owes_the_batch():
    hang = find_hang([progress(0, stalled_s=40, pulse=pulse(0, 40, waiting_in="all_reduce")),
                      progress(1, stalled_s=38, pulse=pulse(1, 38, phase="in step", waiting_in="DataLoader",
                                                            loader_worker=3, loader_worker_pid=4242,
                                                            loader_worker_state="disk wait"))], 1000.0)
    assert hang.finding.rank == 1
    assert ("rank 1 is in a DataLoader wait at train.py:42 load: its worker 3 (pid 4242, disk wait) has not "
            "handed over the batch it owes for 38 s") in hang.finding.summary
    assert "py-spy dump --pid 4242" in hang.finding.action and "timeout=" in hang.finding.action


def test_the_rank_others_wait_for_is_named_before_its_own_allowance_runs_out():
    # Rank 0 is past its 30 s; rank 1, in a DataLoader wait, stopped a second later and is not
    # yet, but has pulsed: the first word of the hang names it, not only the rank waiting for it.
    hang = find_hang([progress(0, stalled_s=31, pulse=pulse(0, 31, waiting_in="all_reduce", collectives_issued=41)),
                      progress(1, stalled_s=29.5, pulse=pulse(1, 29.5, phase="in step", waiting_in="DataLoader",
                                                              loader_worker=0, loader_worker_pid=4242,
                                                              collectives_issued=40))], 1000.0)
    assert hang.finding.rank == 1 and hang.stalled_ranks == [0]
    assert "rank 1 is in a DataLoader wait at train.py:42 load: its worker 0 (pid 4242) has not" in hang.finding.summary
    assert "rank 1 has issued 1 collective fewer than rank 0 (40 against 41)" in hang.finding.summary
    # The other way round: rank 1 past its allowance first, rank 0 still within it, waiting.
    hang = find_hang([progress(0, stalled_s=29.5, pulse=pulse(0, 29.5, waiting_in="all_reduce")),
                      progress(1, stalled_s=31, pulse=pulse(1, 31, phase="in step", waiting_in="DataLoader"))],
                     1000.0)
    assert hang.finding.rank == 1 and hang.stalled_ranks == [1]
    assert "rank 0 waits in all_reduce from backward at train.py:42 load for 30 s" in hang.finding.summary
    # A rank that has not pulsed (it ended a step under PULSE_AFTER_S ago) is not named.
    hang = find_hang([progress(0, stalled_s=31, pulse=pulse(0, 31, waiting_in="all_reduce")),
                      progress(1, stalled_s=2)], 1000.0)
    assert hang.finding.rank is None and "rank 1" not in hang.finding.summary


class HeldRanks:
    """What HangWatch reads of a collector: two ranks' hellos, steps, pulses; a store's meta."""

    def __init__(self):
        self.hellos = {r: SimpleNamespace(pid=100 + r, host="here", started_at_unix_s=0.0) for r in (0, 1)}
        self.recent_by_rank = {r: [_ended(s, start_unix_s=900.0 + s * 0.01) for s in range(20)] for r in (0, 1)}
        self.last_heard_unix_s, self.pulses, self.ends, self.lost_ranks = {}, {}, set(), set()
        self.meta = {}
        self.store = SimpleNamespace(set_meta=self.meta.update)

    def kept_by(self, record_type):  # the steps'
        return self.recent_by_rank

    def latest(self, record_type):
        return {RankHello: self.hellos, RankPulse: self.pulses, RankEnd: dict.fromkeys(self.ends)}[record_type]

    def step_ends(self, rank, step, at_unix_s):
        self.recent_by_rank[rank].append(_ended(step, start_unix_s=at_unix_s - 0.01))


def _ended(step, start_unix_s):
    """A 10 ms step as the collector keeps it, with nothing planned beside it."""
    return SimpleNamespace(step=step, start_unix_s=start_unix_s, step_ms=10.0, eval_ms=0.0, checkpoint_ms=0.0)


def test_a_hang_waits_for_the_first_pulse_of_the_rank_the_others_wait_for():
    # Rank 0 is past a 5 s allowance in all_reduce; rank 1 stopped 0.2 s later and its first
    # pulse is due: the hang waits for it, then names rank 1.
    waiting = progress(0, stalled_s=5.2, pulse=pulse(0, 5.2, waiting_in="all_reduce"))
    assert find_hang([waiting, progress(1, stalled_s=5.0)], 1000.0, hang_after_s=5.0) is None
    hang = find_hang([waiting, progress(1, stalled_s=5.0, pulse=pulse(1, 5.0, phase="in step"))], 1000.0,
                     hang_after_s=5.0)
    assert hang.finding.rank == 1 and "rank 1 is in its own code at train.py:42 load" in hang.finding.summary
    # A pulse that never comes: the hang is told without it once the pulse is overdue.
    late = progress(0, stalled_s=9.0, pulse=pulse(0, 9.0, waiting_in="all_reduce"))
    assert find_hang([late, progress(1, stalled_s=8.5)], 1000.0, hang_after_s=5.0) is not None


def test_a_raised_hang_ends_only_when_a_stalled_rank_steps_again():
    from traceml.report.live import HangWatch

    held, told = HeldRanks(), io.StringIO()
    watch = HangWatch(hang_after_s=30.0, stderr=told)
    now = 1000.0
    held.last_heard_unix_s = {0: now, 1: now}
    held.pulses = {0: pulse(0, 100, steps=20, waiting_in="all_reduce", now=now),
                   1: pulse(1, 100, steps=20, phase="in step", now=now)}
    watch.check(held, now)
    assert watch.hang.finding.rank == 1 and held.meta["hang"]["culprit_rank"] == 1
    # Rank 1's step 20 arrives late (an inferred step), after the pulse that counted 20 steps
    # but taken after it ended: the pulse still places rank 1, and the hang is told once.
    held.step_ends(1, 20, at_unix_s=900.3)
    watch.check(held, now + 1)
    assert watch.hang.finding.rank == 1 and held.meta["hang"]["culprit_rank"] == 1
    assert told.getvalue().count("traceml: HANG") == 1
    # Its next step's record, sent before its next pulse: the rule cannot place it for a moment,
    # and no stalled rank has stepped since the raise, so the hang told stays.
    held.pulses = {0: held.pulses[0]}
    watch.check(held, now + 1.5)
    assert watch.hang is not None and held.meta["hang"]["culprit_rank"] == 1
    # Rank 1 ends a step after the hang was raised: it was a slow step, and the hang is over.
    held.step_ends(1, 21, at_unix_s=now + 2)
    held.step_ends(0, 21, at_unix_s=now + 2)
    watch.check(held, now + 2.5)
    assert watch.hang is None and held.meta["hang"] is None


def test_a_rank_stopped_under_a_hang_that_sends_its_last_step_on_the_way_out_stays_in_it():
    from traceml.report.live import HangWatch

    held = HeldRanks()
    watch = HangWatch(hang_after_s=30.0, stderr=io.StringIO())
    now = 1000.0
    held.last_heard_unix_s = {0: now, 1: now}
    held.pulses = {0: pulse(0, 100, steps=20, waiting_in="all_reduce", now=now),
                   1: pulse(1, 100, steps=20, phase="in step", waiting_in="DataLoader", now=now)}
    watch.check(held, now)
    assert held.meta["hang"]["stalled_ranks"] == [0, 1] and held.meta["hang"]["culprit_rank"] == 1
    # The run is stopped: rank 1, in a DataLoader wait, handles SIGTERM and sends its inferred
    # step 20 (ended before the hang) with its goodbye; rank 0, inside gloo, cannot yet.
    held.step_ends(1, 20, at_unix_s=900.3)
    held.ends.add(1)
    watch.check(held, now + 1)
    assert held.meta["hang"]["stalled_ranks"] == [0, 1] and held.meta["hang"]["culprit_rank"] == 1


def test_a_lost_rank_is_told_by_the_signal_that_ended_it():
    lost = rank_lost([{"rank": 1, "from_step": 15, "exit_code": -9, "pid": 77}],
                     {1: {"exit_code": -9, "pid": 77}, 0: {"exit_code": -15, "pid": 76}}, world_size=2)
    assert lost.kind == "RANK_LOST" and lost.severity == "crit" and lost.rank == 1
    assert lost.summary == ("rank 1 ended without a goodbye some time after step 14 (the last it reported): "
                            "killed by SIGKILL (exit status -9); rank 0 then stopped by the launcher")
    assert "out-of-memory killer" in lost.action
    crash = rank_lost([{"rank": 0, "from_step": 3, "exit_code": -11}], {}, world_size=1)
    assert crash.summary.startswith("the training process ended without a goodbye") and "SIGSEGV" in crash.summary
    assert "PYTHONFAULTHANDLER=1" in crash.action
    elsewhere = rank_lost([{"rank": 5, "from_step": 0}], {}, world_size=8)  # another node's: no status here
    assert "before it reported a step: its exit status was not seen here" in elsewhere.summary
    assert "launcher output" in elsewhere.action
    assert rank_lost([], {0: {"exit_code": -15}}, world_size=2) is None


def test_the_pulse_comes_only_while_no_step_ends_and_reads_the_stack():
    from traceml.probe import pulse as pulses

    clock = [0.0]
    probe = SimpleNamespace(step_index=3, in_step=1, open_phase=-1, in_evaluation=False)
    watch = pulses.PulseWatch(0, probe, threading.get_ident(), clock=lambda: clock[0])
    assert watch.due() is None  # the first look: the count is new
    clock[0] = pulses.PULSE_AFTER_S - 0.1
    assert watch.due() is None
    clock[0] = pulses.PULSE_AFTER_S + 0.1
    sent = watch.due()
    assert sent.steps_ended == 3 and sent.since_progress_s == pytest.approx(pulses.PULSE_AFTER_S + 0.1)
    # Read from this thread: TraceML's own frames left out, this test is the innermost user frame.
    assert sent.stack[0][2] == "test_the_pulse_comes_only_while_no_step_ends_and_reads_the_stack"
    assert sent.innermost.startswith("pulse.py:") and sent.phase == "in step"
    assert watch.due() is None  # not again before PULSE_EVERY_S
    probe.step_index = 4
    clock[0] += pulses.PULSE_EVERY_S
    assert watch.due() is None  # a step ended: quiet again
    site = "/usr/lib/python3/site-packages/torch"
    assert pulses._read([(f"{site}/distributed/distributed_c10d.py", 1, "all_reduce"),
                         ("/home/me/train.py", 9, "main")]) == ("all_reduce", "")
    assert pulses._read([(f"{site}/serialization.py", 1, "save"), ("/home/me/train.py", 9, "main")]) == ("", "checkpoint")
    assert pulses._read([(f"{site}/_dynamo/eval_frame.py", 1, "_fn")]) == ("", "compile")
    # FSDP2 waits for its all-gather inside a dynamo-disabled function: a wait, not a compilation.
    assert pulses._read([(f"{site}/distributed/distributed_c10d.py", 1, "all_gather_single"),
                         (f"{site}/_dynamo/eval_frame.py", 1, "_fn")]) == ("all_gather_single", "")
    assert pulses._read([(f"{site}/utils/data/dataloader.py", 1, "_next_data")]) == ("DataLoader", "")


# -- real runs ------------------------------------------------------------------------------------
class Launched:
    """`traceml run` in the background, its stderr read as it comes."""

    def __init__(self, tmp_path, *script_args, traceml_args=()):
        self.run_dir = tmp_path / "run"
        command = [sys.executable, "-m", "traceml", "run", "--run-dir", str(self.run_dir), "--mode", "summary",
                   *traceml_args, str(HANG_LOOP), *map(str, script_args)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        cwd=tmp_path, env=_env())
        self.stderr_lines = []
        self.stdout = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.stderr_lines.append(line)

    def wait_for(self, text, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in self.stderr_lines if text in line]
            if found:
                return found[0]
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        return None

    def stop(self, timeout_s=60):
        """SIGTERM, as a user's Ctrl-C or a scheduler would send; the exit code. Every process
        the run started must be gone within 15 s after."""
        try:
            started = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.stdout, _ = self.process.communicate(timeout=timeout_s)
        finally:
            self._reader.join(timeout=5)
            _, left = psutil.wait_procs(started, timeout=15)
            for process in left:
                process.kill()
        assert not left, f"left behind: {[process.pid for process in left]}"
        return self.process.returncode

    def summary(self):
        return json.loads((self.run_dir / "final_summary.json").read_text())


def test_a_rank_in_its_own_code_is_named_with_its_line_and_the_run_keeps_the_hang(tmp_path):
    # The loop averages its gradients on a group of its own: the counts that say who is behind
    # are that group's, the default group's being the same on both ranks.
    run = Launched(tmp_path, "--stall-rank", 1, "--at", 15, "--grads-on-subgroup", traceml_args=(
        "--nproc-per-node", "2", "--hang-after", "5", "--on-alert", f"cat >> {tmp_path / 'alerts.jsonl'}"))
    try:
        started = time.monotonic()
        line = run.wait_for("traceml: HANG", timeout_s=90)
        assert line is not None, "".join(run.stderr_lines)[-3000:]
        assert time.monotonic() - started < 90
        assert "rank 1 is in its own code at hang_loop.py" in line and "load_shard" in line
        assert "rank 0 waits in all_reduce" in line
        assert re.search(r"rank 1 has issued 1 collective fewer than rank 0 on the group of ranks 0, 1 "
                         r"\((\d+) against (\d+)\)", line), line
        alerts_file = tmp_path / "alerts.jsonl"
        deadline = time.monotonic() + 15  # the alert thread looks every 2 s
        while time.monotonic() < deadline and '"HANG"' not in (alerts_file.read_text() if alerts_file.exists() else ""):
            time.sleep(0.2)
        time.sleep(4)  # two more looks: the same hang must not be sent again
    finally:
        returncode = run.stop()
    assert returncode == 1  # torch.distributed.run's own, stopped by SIGTERM without TraceML
    summary = run.summary()
    assert summary["primary_diagnosis"]["kind"] == "HANG" and summary["primary_diagnosis"]["rank"] == 1
    places = {place["rank"]: place for place in summary["hang"]["ranks"]}
    assert places[1]["state"] == "own code" and places[1]["last_step"] == 14
    assert any("hang_loop.py" in frame and "load_shard" in frame for frame in places[1]["stack"])
    assert places[0]["state"] == "collective" and places[0]["waiting_in"] == "all_reduce"
    assert places[0]["waiting_group"] == "ranks 0, 1" and places[0]["collectives_issued"] == places[1]["collectives_issued"]
    on_group = {rank: place["subgroup_collectives"]["ranks 0, 1"] for rank, place in places.items()}
    assert on_group[0] == on_group[1] + 1 and summary["primary_diagnosis"]["evidence"]["decided_on_group"] == "ranks 0, 1"
    assert "Hang" in run.stdout.splitlines()[2]  # among the card's first lines
    # --on-alert: one JSON document for the hang, however many checks saw it.
    alerts = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    hangs = [alert for alert in alerts if alert["kind"] == "HANG"]
    assert len(hangs) == 1 and hangs[0]["rank"] == 1 and hangs[0]["script"] == "hang_loop.py"
    assert len({(alert["kind"], alert["rank"]) for alert in alerts}) == len(alerts)


@pytest.mark.parametrize("stall_in, phase", [("before-forward", "in step"), ("forward", "forward"),
                                              ("optimizer", "optimizer")])
def test_under_ddp_the_rank_that_has_not_arrived_is_named_not_the_one_in_backward(tmp_path, stall_in, phase):
    # Rank 1 stalls in its own code: before forward, in a layer's forward, in its optimizer's
    # step. Rank 0 goes on to backward, where DDP's reducer waits in C++ for the all-reduce it
    # issued: no collective frame on its stack, one collective more in its count. Allowed 8 s,
    # as the DataLoader test: each rank's first pulse comes 5 s after its last step.
    run = Launched(tmp_path, "--ddp", "--stall-rank", 1, "--at", 15, "--stall-in", stall_in,
                   traceml_args=("--nproc-per-node", "2", "--hang-after", "8"))
    try:
        line = run.wait_for("traceml: HANG", timeout_s=90)
        assert line is not None, "".join(run.stderr_lines)[-3000:]
    finally:
        returncode = run.stop()
    assert returncode == 1  # torch.distributed.run's own under SIGTERM
    # Rank 1 stops a moment after rank 0; on a loaded machine the line may come before rank 1
    # is past its own allowance, and then lists rank 0 alone as stalled, rank 1 named all the same.
    assert re.search(r"on (?:rank 0|ranks 0, 1): rank 1 is in its own code at hang_loop\.py:\d+ load_shard "
                     rf"\({phase}\); rank 0 waits in DDP's all_reduce from backward at hang_loop\.py:\d+ main "
                     r"for \d+ s; rank 1 has issued 1 collective fewer than rank 0", line), line
    summary = run.summary()
    hang, finding = summary["hang"], summary["primary_diagnosis"]
    assert hang["culprit_rank"] == 1 and finding["kind"] == "HANG" and finding["rank"] == 1
    assert re.match(r"Look at rank 1's hang_loop\.py:\d+ load_shard: the other ranks wait for it",
                    finding["action"]), finding["action"]
    waiting, stalled = hang["ranks"]
    assert (waiting["state"], waiting["phase"], waiting["waiting_in"]) == ("collective", "backward", "DDP's all_reduce")
    assert (stalled["state"], stalled["phase"]) == ("own code", phase)
    assert waiting["collectives_issued"] == stalled["collectives_issued"] + 1


def test_a_rank_whose_dataloader_worker_hangs_is_named_live_on_metrics(tmp_path):
    port = _free_port()
    # Allowed 8 s: rank 0, waiting for rank 1 in all_reduce, says so in its first pulse, 5 s
    # after its last step; allowed 5 s, the hang was told at times on a busy machine before that
    # pulse came, without rank 0's place.
    run = Launched(tmp_path, "--hang-worker-rank", 1, "--at", 10, "--zero-code",
                   traceml_args=("--nproc-per-node", "2", "--hang-after", "8", "--metrics-port", str(port),
                                 "--on-alert", "sleep 60"))
    try:
        line = run.wait_for("traceml: HANG", timeout_s=90)
        assert line is not None, "".join(run.stderr_lines)[-3000:]
        # The worker sleeps in a loop; on a busy machine it may be caught running.
        assert re.search(r"rank 1 is in a DataLoader wait at hang_loop\.py:\d+ main: its worker 0 \(pid \d+, "
                         r"(sleeping|running)\) has not handed over the batch it owes", line), line
        assert "rank 0 waits in all_reduce" in line
        assert "rank 1 has issued 1 collective fewer than rank 0" in line
        # The line places every rank that has pulsed once one is past its 8 s; on a busy machine
        # the other crosses its own a second or two later, and only then is it stalled on /metrics.
        deadline, metrics = time.monotonic() + 15, ""
        while not ('traceml_stalled{rank="1"} 1.0' in metrics and 'traceml_stalled{rank="0"} 1.0' in metrics):
            assert time.monotonic() < deadline, [m for m in metrics.splitlines() if m.startswith("traceml_stalled")]
            time.sleep(0.5)
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        # The alert command that never ends is stopped after its 10 s; the run goes on.
        assert run.wait_for("ran past 10 s for HANG and was stopped", timeout_s=30) is not None
        assert run.process.poll() is None
    finally:
        returncode = run.stop()
    assert returncode == 1  # torch.distributed.run's own under SIGTERM
    hang = run.summary()["hang"]
    assert hang["stalled_ranks"] == [0, 1] and hang["culprit_rank"] == 1
    assert hang["ranks"][1]["state"] == "input" and hang["ranks"][1]["loader_worker"]["worker"] == 0


def test_one_process_in_its_own_code_is_named_and_a_slow_save_and_a_compile_are_not(tmp_path):
    # Allowed 2 s without a step: the 8 s save (to a slow disk) and the first compilation (by a
    # compiler that takes 8 s), both mid-run, outlast it; only the stall at step 20 is a hang.
    run = Launched(tmp_path, "--save-at", 5, "--save-s", 8, "--compile-at", 10, "--compile-s", 8,
                   "--stall-rank", 0, "--at", 20,
                   traceml_args=("--hang-after", "2"))
    try:
        line = run.wait_for("traceml: HANG", timeout_s=240)
        assert line is not None, "".join(run.stderr_lines)[-3000:]
        assert re.search(r"rank 0 is in its own code at hang_loop\.py:\d+ load_shard", line), line
        time.sleep(3)  # three more checks: the same hang is not told again
    finally:
        returncode = run.stop()
    assert returncode == 143  # as `python hang_loop.py` stopped by SIGTERM
    assert len([line for line in run.stderr_lines if "traceml: HANG" in line]) == 1
    summary = run.summary()
    assert summary["hang"]["ranks"][0]["last_step"] == 19
    assert summary["goodput"]["checkpoint"]["seconds"] > 7.5
    # What makes the test: the compilation outlasted the allowance and the first pulse's 5 s.
    assert summary["compile"]["compile_s"] > 2 + 5


def test_a_killed_rank_is_named_gone_with_its_exit_status(traceml_run):
    run = traceml_run("--kill-rank", 1, "--at", 15, script=HANG_LOOP,
                      traceml_args=("--nproc-per-node", "2", "--mode", "summary"), timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]  # torch.distributed.run's own for a failed rank
    summary = run.summary()
    lost = summary["primary_diagnosis"]
    assert lost["kind"] == "RANK_LOST" and lost["rank"] == 1
    assert lost["evidence"]["signal"] == "SIGKILL" and lost["evidence"]["exit_code"] == -9
    assert "killed by SIGKILL (exit status -9); rank 0 then stopped by the launcher" in lost["summary"]
    assert summary["run"]["exit_code"] == run.returncode
    [missing] = summary["missing_ranks"]
    assert missing["rank"] == 1 and missing["exit_code"] == -9 and missing["from_step"] <= 15
    # Both ranks' steps before it are kept, and rank 0's up to where the launcher stopped it.
    assert {r["rank"] for r in summary["ranks"]} == {0, 1}
    assert max(row["step"] for row in run.step_rows() if row["rank"] == 0) >= missing["from_step"]
    card = re.sub(r"[\s│]+", " ", run.stdout)
    assert "Verdict RANK_LOST" in card and "(stopped reporting without a goodbye: killed by SIGKILL)" in card
    assert "rank 1 from step" in re.sub(r"[\s│]+", " ", (run.run_dir / "final_summary.txt").read_text())


def test_evaluation_on_every_rank_and_a_slow_step_that_ends_raise_none(traceml_run, tmp_path):
    # Allowed 10 s without a step: every rank's 20 s evaluation before step 10 outlasts it, and
    # rank 1's single slow step at 20 (6 s, 300 of its median steps) ends inside it.
    run = traceml_run("--eval-s", 20, "--eval-at", 10, "--stall-rank", 1, "--stall-s", 6, "--at", 20,
                      "--steps", 30, script=HANG_LOOP,
                      traceml_args=("--nproc-per-node", "2", "--hang-after", "10", "--mode", "summary"), timeout=240)
    assert ended_well(run), run.stderr[-3000:]
    assert "HANG" not in run.stderr
    summary = run.summary()
    assert summary["hang"] is None and all(f["kind"] != "HANG" for f in summary["findings"])
    assert summary["primary_diagnosis"]["kind"] != "HANG"
    # What makes the test: the evaluation and the slow step both happened, as told.
    assert summary["goodput"]["evaluation"]["seconds"] > 2 * 10
    (slow,) = [row for row in run.step_rows() if row["step"] == 20 and row["rank"] == 1]
    assert slow["step_ms"] > 6000


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
