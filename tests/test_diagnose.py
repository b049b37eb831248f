"""The step-time rules, on synthetic rolled-up steps, at and around every threshold."""
import random

import pytest

from traceml.analysis.rollup import Window, roll_up
from traceml.records import warmup_steps
from traceml.records import RolledStep
from traceml.diagnose import DiagnosisInput, diagnose
from traceml.diagnose.step_time import (COMPUTE_SHARE, LINE_MARGIN, MIN_STEPS, UNTRACED_CRIT_SHARE,
                                        UNTRACED_WARN_SHARE, WAIT_CRIT_SHARE, WAIT_WARN_SHARE)
from test_records import step


def rolled(index: int, **phases_ms: float) -> RolledStep:
    """A 100 ms step: the given phases, the rest of it forward."""
    values = {name: phases_ms.get(name, 0.0) for name in
              ("input_wait", "outside", "h2d", "backward", "optimizer", "untraced", "gc")}
    forward = 100.0 - sum(v for k, v in values.items() if k != "gc")
    assert forward >= 0
    return RolledStep(step=index, ranks=1, start_unix_s=float(index), step_ms=100.0, worst_rank=0,
                      worst_step_ms=100.0, forward_ms=forward, samples=8, device_timed=False,
                      gc_collections=1.0 if values["gc"] else 0.0, gc_max_pause_ms=values["gc"],
                      gc_gen2_ms=values["gc"],
                      gpu_idle_ms=None, device_allocated_bytes=None, device_peak_bytes=None,
                      device_reserved_bytes=None, host_rss_bytes=None,
                      **{f"{name}_ms": value for name, value in values.items()})


def window(count: int = 20, **phases_ms: float) -> Window:
    return Window([rolled(i, **phases_ms) for i in range(count)])


def kinds(findings):
    return {f.kind: f.severity for f in findings}


@pytest.mark.parametrize("phase,kind", [("input_wait", "INPUT_BOUND"), ("h2d", "H2D_BOUND")])
@pytest.mark.parametrize("share,severity", [
    # The line is at 10%; as the verdict, a share must clear it by LINE_MARGIN (12.5%), its
    # interval above 7.5%; within LINE_MARGIN of it (from 7.5%) it is told as at the line
    # (info, never the verdict). These steps are all alike: the interval is the share itself.
    (0.074, None), (0.075, "info"), (WAIT_WARN_SHARE, "info"), (0.124, "info"), (0.125, "warn"),
    (WAIT_CRIT_SHARE - 0.001, "warn"), (WAIT_CRIT_SHARE, "crit"), (0.6, "crit")])
def test_waiting_rules_at_their_thresholds(phase, kind, share, severity):
    assert WAIT_WARN_SHARE * (1 + LINE_MARGIN) == pytest.approx(0.125)
    assert WAIT_WARN_SHARE * (1 - LINE_MARGIN) == pytest.approx(0.075)
    findings = diagnose(DiagnosisInput(window(**{phase: share * 100.0}), steps_seen=20))
    assert kinds(findings).get(kind) == severity
    if severity == "info":  # told under Also: the verdict is the healthy run's
        assert findings[0].kind == "COMPUTE_BOUND"


def noisy_window(mean_wait_ms: float, seed: int, count: int = 300) -> Window:
    """100 ms steps whose input wait scatters around mean_wait_ms, a stall now and then."""
    rng = random.Random(seed)
    steps = []
    for index in range(count):
        wait = max(0.0, rng.gauss(mean_wait_ms, mean_wait_ms / 3))
        if rng.random() < 0.03:
            wait += 4 * mean_wait_ms
        steps.append(rolled(index, input_wait=min(wait, 90.0)))
    return Window(steps)


@pytest.mark.parametrize("mean_wait_ms", [7.0, 8.0, 9.0, 10.0])
def test_a_share_that_sits_on_the_line_gives_the_same_verdict_run_after_run(mean_wait_ms):
    # The same loop, run after run: input wait a little under or over the 10% line each time
    # (7.6% to 11.8% of the step over these windows; four real runs of one loop gave 7.7-11.8%).
    for seed in range(5):
        findings = diagnose(DiagnosisInput(noisy_window(mean_wait_ms, seed), steps_seen=300))
        assert findings[0].kind == "COMPUTE_BOUND", findings[0]
        (finding,) = [f for f in findings if f.kind == "INPUT_BOUND"]
        assert finding.severity == "info"
        low, high = finding.evidence["share_low"], finding.evidence["share_high"]
        assert low < finding.evidence["share"] < high  # the 95% interval, from the block bootstrap
        assert "at the 10% line (95% interval " in finding.summary
        assert "; 12.5% needed, the interval above 7.5%)" in finding.summary


def test_a_share_clear_of_the_line_is_the_verdict():
    findings = diagnose(DiagnosisInput(noisy_window(16.0, seed=0), steps_seen=300))
    assert findings[0].kind == "INPUT_BOUND" and findings[0].severity == "warn"
    assert findings[0].evidence["share"] >= 0.125 and findings[0].evidence["share_low"] >= 0.075


def test_a_share_clear_of_the_line_but_too_noisy_to_be_sure_is_at_the_line():
    # 15% of the step on average, but all of it in a few long waits: the interval reaches under
    # 7.5%, where the share could as well be below the line.
    rng = random.Random(1)
    noisy = Window([rolled(i, input_wait=90.0 if rng.random() < 0.15 else 0.5) for i in range(40)])
    low = noisy.share_interval("input_wait")[0]
    assert noisy.share("input_wait") >= 0.125 and low < 0.075
    (finding,) = [f for f in diagnose(DiagnosisInput(noisy, steps_seen=40)) if f.kind == "INPUT_BOUND"]
    assert finding.severity == "info"


@pytest.mark.parametrize("share,severity", [
    (UNTRACED_WARN_SHARE - 0.001, None), (UNTRACED_WARN_SHARE, "warn"),
    (UNTRACED_CRIT_SHARE - 0.001, "warn"), (UNTRACED_CRIT_SHARE, "crit")])
def test_untraced_work_at_its_thresholds(share, severity):
    # Split between outside and untraced: the rule looks at their sum.
    findings = diagnose(DiagnosisInput(window(outside=share * 60.0, untraced=share * 40.0), steps_seen=20))
    assert kinds(findings).get("UNTRACED_WORK") == severity


def test_untraced_work_names_where_the_time_is():
    outside = [f for f in diagnose(DiagnosisInput(window(outside=40.0), steps_seen=20)) if f.kind == "UNTRACED_WORK"][0]
    inside = [f for f in diagnose(DiagnosisInput(window(untraced=40.0), steps_seen=20)) if f.kind == "UNTRACED_WORK"][0]
    assert "between steps" in outside.summary and "item()" in outside.action
    assert "inside the step" in inside.summary and "trace_step(model)" in inside.action


@pytest.mark.parametrize("compute,expected", [(COMPUTE_SHARE - 0.001, False), (COMPUTE_SHARE, True),
                                              (0.95, True)])
def test_compute_bound_when_the_model_dominates(compute, expected):
    # Compute = forward (the rest) + 10 ms backward; the remainder is outside.
    outside = 100.0 - compute * 100.0
    findings = diagnose(DiagnosisInput(window(outside=outside, backward=10.0), steps_seen=20))
    assert ("COMPUTE_BOUND" in kinds(findings)) is expected
    if expected:
        finding = [f for f in findings if f.kind == "COMPUTE_BOUND"][0]
        assert finding.severity == "info"
        assert "autocast" in finding.action


def test_a_healthy_compute_bound_run_has_it_as_primary():
    findings = diagnose(DiagnosisInput(window(input_wait=2.0, outside=3.0, untraced=5.0, backward=40.0), steps_seen=20))
    assert [f.kind for f in findings] == ["COMPUTE_BOUND"]


def test_primary_is_what_acting_on_it_would_win_not_the_most_severe():
    # 35% between steps (warn) is worth more of the run than 25% input wait (crit).
    findings = diagnose(DiagnosisInput(window(input_wait=25.0, h2d=13.0, outside=35.0), steps_seen=20))
    assert [(f.kind, f.severity) for f in findings] == [
        ("UNTRACED_WORK", "warn"), ("INPUT_BOUND", "crit"), ("H2D_BOUND", "warn")]


def test_every_window_gets_a_verdict():
    # Nothing above a threshold alone: 9% input, 9% h2d, 49% compute leaves 33% untraced.
    findings = diagnose(DiagnosisInput(window(input_wait=9.0, h2d=9.0, outside=33.0), steps_seen=20))
    assert findings and findings[0].kind == "UNTRACED_WORK"


@pytest.mark.parametrize("steps_seen,insufficient", [(MIN_STEPS - 1, True), (MIN_STEPS, False)])
def test_insufficient_data_below_ten_steps(steps_seen, insufficient):
    findings = diagnose(DiagnosisInput(window(count=steps_seen, input_wait=50.0), steps_seen=steps_seen))
    assert (findings[0].kind == "INSUFFICIENT_DATA") is insufficient
    if insufficient:
        assert len(findings) == 1 and str(steps_seen) in findings[0].summary


@pytest.mark.parametrize("count,warmup", [(5, 0), (9, 0), (10, 1), (30, 3), (50, 5), (1000, 5)])
def test_warmup_is_a_tenth_of_the_run_up_to_five_steps(count, warmup):
    assert warmup_steps(count) == warmup


def test_window_shares_add_up_and_medians_are_per_phase():
    w = window(input_wait=20.0, backward=30.0)
    assert sum(w.phases[p].share for p in ("input_wait", "outside", "h2d", "forward", "backward",
                                           "optimizer", "untraced")) == pytest.approx(1.0)
    assert w.phases["input_wait"].median_ms == 20.0
    assert w.step_median_ms == 100.0 and w.step_p90_ms == 100.0


def test_rollup_takes_medians_across_ranks_and_names_the_worst():
    records = []
    for rank, step_ms in ((0, 100.0), (1, 140.0), (2, 110.0)):
        record = step(7)
        record.rank, record.step_ms, record.input_wait_ms = rank, step_ms, step_ms - 90.0
        records.append(record)
    (rolled_step,) = roll_up(records)
    assert rolled_step.ranks == 3
    assert rolled_step.step_ms == 110.0 and rolled_step.input_wait_ms == 20.0
    assert (rolled_step.worst_rank, rolled_step.worst_step_ms) == (1, 140.0)
    assert rolled_step.samples == 24


# -- GC, spikes, memory: the rules of the long runs ------------------------------------------
from traceml.diagnose.memory import (PRESSURE_CRIT, PRESSURE_WARN, MemoryLimits, memory_creep,
                                     memory_pressure, out_of_memory)
from traceml.diagnose.spikes import WARN_COST_SHARE, Stalls, step_spikes
from traceml.diagnose.step_time import GC_CRIT_SHARE, GC_WARN_SHARE
from traceml.records import OomRecord


@pytest.mark.parametrize("share,severity", [(GC_WARN_SHARE - 0.001, None), (GC_WARN_SHARE, "warn"),
                                            (GC_CRIT_SHARE - 0.001, "warn"), (GC_CRIT_SHARE, "crit")])
def test_gc_pressure_at_its_thresholds(share, severity):
    findings = diagnose(DiagnosisInput(window(gc=share * 100.0), steps_seen=20))
    assert kinds(findings).get("GC_PRESSURE") == severity


def spiky_window(period=None, at=(), count=100, spike_ms=120.0, phase="untraced"):
    steps = []
    for index in range(count):
        spike = (period and index % period == period - 1) or index in at
        step = rolled(index)
        if spike:
            step.step_ms += spike_ms
            setattr(step, f"{phase}_ms", getattr(step, f"{phase}_ms") + spike_ms)
        steps.append(step)
    return Window(steps)


def test_periodic_spikes_name_their_period_and_phase():
    found = step_spikes(Stalls(spiky_window(period=20, phase="optimizer")))
    assert found.evidence["period_steps"] == 20 and found.evidence["phase"] == "optimizer"
    assert found.evidence["episodes"] == 5 and "every 20 steps" in found.summary
    assert found.evidence["share"] == pytest.approx(600.0 / 10600.0, rel=1e-3)


def test_rare_irregular_hiccups_are_not_a_finding():
    assert step_spikes(Stalls(spiky_window(at=(33, 58, 91)))) is None  # 3 irregular, 3.5% of the time
    assert step_spikes(Stalls(Window([rolled(i) for i in range(100)]))) is None


def memory_window(held, device=True):
    steps = []
    for index, value in enumerate(held):
        step = rolled(index)
        if device:
            step.device_allocated_bytes = int(value)
        else:
            step.host_rss_bytes = int(value)
        steps.append(step)
    return Window(steps)


MIB = 2 ** 20


def test_creep_that_would_take_a_thousand_windows_to_run_out_is_no_verdict():
    # 12 MiB over 94 steps on 440 MiB held, 23 GiB free: a busy machine's RSS drift, not a leak.
    drift = memory_creep(memory_window([440 * MIB + i * 128 * 1024 for i in range(95)], device=False),
                         MemoryLimits(host_available_bytes=23 * 1024 * MIB))
    assert drift.severity == "warn"
    # A graph kept every step: far from running out, but growing by a third of what is held.
    leak = memory_creep(memory_window([300 * MIB + i * 2 * MIB for i in range(55)], device=False),
                        MemoryLimits(host_available_bytes=23 * 1024 * MIB))
    assert leak.severity == "crit"


def test_creep_gives_bytes_per_step_and_the_step_memory_runs_out():
    found = memory_creep(memory_window([1024 * MIB + i * 2 * MIB for i in range(50)]),
                         MemoryLimits(device_capacity_bytes=2048 * MIB))
    assert found.evidence["bytes_per_step"] == pytest.approx(2 * MIB)
    # 1024 + 98 MiB held at step 49; (2048 - 1122) / 2 = 463 steps more.
    assert found.evidence["projected_oom_step"] == 49 + 463
    assert "runs out near step 512" in found.summary


def test_a_stalled_rss_reader_does_not_hide_a_leak():
    # 2 MiB a step; the thread that reads RSS waited through steps 14-29 on a busy machine,
    # so those steps repeat step 13's reading: 16 flat steps, then a jump of 32 MiB.
    held = [300 * MIB + min(i, 13 if 14 <= i <= 29 else i) * 2 * MIB for i in range(45)]
    found = memory_creep(memory_window(held, device=False), MemoryLimits(host_available_bytes=16 * 1024 * MIB))
    assert found is not None and found.evidence["bytes_per_step"] == pytest.approx(2 * MIB, rel=0.05)
    assert found.evidence["steps"] == 45


@pytest.mark.parametrize("held", [
    [1024 * MIB] * 50,  # flat
    [1024 * MIB + (i % 2) * 64 * MIB for i in range(50)],  # noisy, no trend
    [1024 * MIB + (64 * MIB if i > 20 else 0) for i in range(50)],  # one step up: warm-up
])
def test_no_creep_without_a_lasting_trend(held):
    assert memory_creep(memory_window(held), MemoryLimits(device_capacity_bytes=4096 * MIB)) is None


@pytest.mark.parametrize("ratio,severity", [(PRESSURE_WARN - 0.001, None), (PRESSURE_WARN, "warn"),
                                            (PRESSURE_CRIT, "crit")])
def test_memory_pressure_at_its_thresholds(ratio, severity):
    found = memory_pressure(window(), MemoryLimits(device_capacity_bytes=1000 * MIB),
                            peak_device_bytes=int(ratio * 1000 * MIB), peak_rss_bytes=None)
    assert (found.severity if found else None) == severity
    if found:
        assert found.evidence["headroom_bytes"] == 1000 * MIB - int(ratio * 1000 * MIB)


def test_out_of_memory_is_the_primary_finding_even_in_a_short_run():
    oom = OomRecord(rank=0, step=3, phase="backward", layer="blocks.2.mlp", message="CUDA out of memory",
                    allocated_bytes=79 * 2 ** 30, reserved_bytes=80 * 2 ** 30, peak_bytes=79 * 2 ** 30,
                    largest_layers=[("blocks.2.mlp", 3 * 2 ** 30)])
    findings = diagnose(DiagnosisInput(window(count=3), steps_seen=3, oom=oom,
                        limits=MemoryLimits(device_capacity_bytes=80 * 2 ** 30)))
    assert [f.kind for f in findings] == ["MEMORY_PRESSURE", "INSUFFICIENT_DATA"]
    assert "in backward, inside layer blocks.2.mlp" in findings[0].summary
    assert "79.00 GiB allocated of 80.00 GiB" in findings[0].summary
    assert out_of_memory(oom, MemoryLimits()).evidence["oom"] is True


# -- Calibrated verdicts: episodes, periods, warm-up, one cause one finding, the ranking ------
from traceml.diagnose import VERDICT_SHARE, rank
from traceml.analysis.goodput import PARTS, Goodput
from traceml.records import (STEPS_FROM_BACKWARD, STEPS_FROM_OPTIMIZER, STEPS_FROM_TRACE_STEP,
                             Finding, SystemSample)


def stalled_window(slow_steps, count=100, extra_ms=150.0, **where_ms):
    """100 ms steps, mostly forward; the given steps `extra_ms` longer, split as where_ms says
    (by default all in untraced)."""
    where_ms = where_ms or {"untraced": 1.0}
    steps = []
    for index in range(count):
        step = rolled(index, backward=30.0, optimizer=10.0)
        if index in slow_steps:
            step.step_ms += extra_ms
            for name, part in where_ms.items():
                setattr(step, f"{name}_ms", getattr(step, f"{name}_ms") + part * extra_ms)
        steps.append(step)
    return Window(steps)


def test_consecutive_slow_steps_are_one_stall_never_every_1_steps():
    stalls = Stalls(stalled_window(range(50, 56)))
    assert [(e.first_step, e.steps) for e in stalls.episodes] == [(50, 6)]
    assert stalls.period is None
    found = step_spikes(stalls)
    assert "every 1 steps" not in found.summary and "once, 6 steps in a row" in found.summary
    # One slow step alone: "1 step takes", "once", "it costs"; its cost given with its base.
    found = step_spikes(Stalls(stalled_window({50}, extra_ms=1000.0)))
    assert found.summary == ("1 step takes 1100.0 ms against a median of 100.0 ms, once; untraced grows "
                             "by 1000.0 ms in it; it costs 1.0 s over the median step, 9.1% of the 11.0 s "
                             "of measured steps")


def test_one_stall_ten_times_longer_hides_neither_the_period_nor_its_cost():
    # A sync inside every 10th step: 150 ms; the one at step 49 waited 2000 ms.
    window = stalled_window(set(range(9, 100, 10)), extra_ms=150.0)
    window.steps[49].step_ms += 1850.0
    window.steps[49].untraced_ms += 1850.0
    window = Window(window.steps)
    stalls = Stalls(window)
    assert stalls.period == 10 and [s.step for s in stalls.outliers] == [49]
    said_ms = 9 * 150.0 + 2000.0  # nine typical stalls and the outlier, as the words give them
    (untraced,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=100)) if f.kind == "UNTRACED_WORK"]
    assert untraced.evidence["period_steps"] == 10 and untraced.evidence["outliers"] == [{"step": 49, "ms": 2000.0}]
    assert untraced.summary == ("every 10 steps, untraced work inside the step takes more in 10 steps: 9 of "
                                "about 150 ms, one of 2000 ms at step 49, against a median step of 100.0 ms: "
                                "3.4 s, 25.1% of the 13.3 s of measured steps")
    assert untraced.evidence["stall_share"] == pytest.approx(said_ms / window.total_ms, abs=1e-4)
    # Told as slow steps, the same stalls add up to their cost the same way.
    spikes = step_spikes(stalls)
    assert spikes.summary.startswith("10 steps are slow: 9 of about 250.0 ms, one of 2100.0 ms at step 49, "
                                     "against a median of 100.0 ms, every 10 steps;")
    assert spikes.summary.endswith("they cost 3.4 s over the median step, 25.1% of the 13.3 s of measured steps")
    assert spikes.evidence["share"] == pytest.approx(said_ms / window.total_ms, abs=1e-4)


def test_a_period_needs_three_repeats_two_or_more_steps_apart():
    assert Stalls(stalled_window({40, 60})).period is None  # twice is not a period
    assert Stalls(stalled_window({30, 50, 70, 90})).period == 20
    # Stalls of two steps each, every 25 steps: the period is between their starts.
    assert Stalls(stalled_window({25, 26, 50, 51, 75, 76})).period == 25


def test_early_slow_steps_that_never_come_back_are_warm_up_not_a_finding():
    window = stalled_window({8, 12, 13})  # the allocator and optimizer state warming up
    stalls = Stalls(window)
    assert not stalls.episodes
    assert [(w["first_step"], w["steps"]) for w in stalls.warmup_note()] == [(8, 1), (12, 2)]
    findings = diagnose(DiagnosisInput(window, steps_seen=100))
    assert findings[0].kind == "COMPUTE_BOUND" and "STEP_SPIKES" not in kinds(findings)
    # The same stalls that come back later are not warm-up.
    assert Stalls(stalled_window({8, 12, 13, 60, 61})).episodes


def test_steps_traceml_slowed_itself_are_never_spikes():
    window = stalled_window({10, 20, 30, 40, 50, 60, 70, 80, 90})
    for step in window.steps:
        step.instrumented = step.step % 10 == 0  # deep-dive every 10 steps
    assert not Stalls(window).episodes
    assert "STEP_SPIKES" not in kinds(diagnose(DiagnosisInput(window, steps_seen=100)))


def test_a_machine_wide_stall_is_named_as_such_not_blamed_on_a_phase():
    slow = {23, 41, 42, 67, 88}
    # Every phase 2.5 times longer at once: the machine, not the optimizer.
    steps = []
    for index in range(100):
        step = rolled(index, backward=30.0, optimizer=10.0)
        if index in slow:
            for name in ("forward", "backward", "optimizer"):
                setattr(step, f"{name}_ms", getattr(step, f"{name}_ms") * 2.5)
            step.step_ms *= 2.5
        steps.append(step)
    busy = [SystemSample(unix_s=float(i), cpu_percent=95.0, ram_used_bytes=1, ram_total_bytes=2,
                         training_cpu_percent=100.0, training_rss_bytes=1, cpu_count=2)
            for i in range(100)]
    found = step_spikes(Stalls(Window(steps), busy))
    assert found.evidence["machine_wide"] is True and found.evidence["other_cpu_cores"] == pytest.approx(0.9)
    assert found.summary.startswith("the machine stalls the training")
    assert "other processes used 0.9 CPU cores" in found.summary and "OMP_NUM_THREADS" in found.action


def test_periodic_untraced_work_is_one_finding_told_by_its_period():
    # A synchronous save-like stall inside the step every 20 steps: 1 s each, not torch.save.
    window = stalled_window({19, 39, 59, 79, 99}, extra_ms=1000.0)
    findings = diagnose(DiagnosisInput(window, steps_seen=100))
    assert [f.kind for f in findings].count("UNTRACED_WORK") == 1 and "STEP_SPIKES" not in kinds(findings)
    primary = findings[0]
    assert primary.kind == "UNTRACED_WORK" and primary.evidence["period_steps"] == 20
    assert primary.summary.startswith("every 20 steps, untraced work inside the step takes 1000 ms")
    assert primary.summary.endswith(f": 5.0 s, {primary.evidence['share']:.1%} of the 15.0 s of measured steps")


def busy_machine(seconds=100, other_cores=0.9):
    """System samples of a 2-core machine on which other processes use other_cores."""
    return [SystemSample(unix_s=float(i), cpu_percent=(1.0 + other_cores) * 50.0, ram_used_bytes=1,
                         ram_total_bytes=2, training_cpu_percent=100.0, training_rss_bytes=1, cpu_count=2)
            for i in range(seconds)]


def jittery_window(stall_every=None, stall_ms=250.0, count=100):
    """A busy machine's steps: compute between 50 and 190 ms (the spread of a 2-core run beside
    a CPU hog), and, every stall_every steps, stall_ms of untraced work."""
    steps = []
    for index in range(count):
        jitter_ms = (index * 37 % 15) * 10.0  # 0 to 140 ms, in no order a period could match
        step = rolled(index, backward=30.0, optimizer=10.0)
        step.forward_ms += jitter_ms
        step.step_ms += jitter_ms
        if stall_every and index % stall_every == stall_every - 1:
            step.untraced_ms += stall_ms
            step.step_ms += stall_ms
        steps.append(step)
    return Window(steps)


def test_a_periodic_stall_is_found_in_its_own_part_when_the_machine_jitters():
    window = jittery_window(stall_every=10)
    # On the whole step the stalls drown in the jitter; in untraced time they stand alone.
    stalls = Stalls(window)
    assert stalls.period == 10 and stalls.phase == "untraced"
    assert stalls.growth_ms["untraced"] == pytest.approx(250.0)
    findings = diagnose(DiagnosisInput(window, steps_seen=100))
    # Its mean share (under 15%) is under UNTRACED_WORK's own line: named by its cause all the same.
    assert window.share("untraced") < UNTRACED_WARN_SHARE
    primary = findings[0]
    assert primary.kind == "UNTRACED_WORK" and primary.evidence["period_steps"] == 10
    assert primary.summary.startswith("every 10 steps, untraced work inside the step takes 250 ms")
    assert "STEP_SPIKES" not in kinds(findings)
    # Without the stall, the jitter alone is no period and no finding.
    assert Stalls(jittery_window()).period is None


def test_irregular_stalls_on_a_busy_machine_are_the_machines_and_listed_under_also():
    # Descheduled now and then: each stall lands in whichever phase ran, here the forward.
    window = stalled_window({23, 41, 42, 58, 67, 88}, extra_ms=250.0, forward=1.0)  # 13% of the run
    quiet = diagnose(DiagnosisInput(window, steps_seen=100))
    assert quiet[0].kind == "STEP_SPIKES" and quiet[0].evidence["machine_wide"] is False
    busy = diagnose(DiagnosisInput(window, steps_seen=100, system=busy_machine()))
    assert busy[0].kind == "COMPUTE_BOUND"
    spikes = next(f for f in busy if f.kind == "STEP_SPIKES")
    assert spikes.evidence["machine_wide"] is True and spikes.summary.startswith("the machine stalls")
    # A periodic stall of one part is the run's own, busy machine or not.
    periodic = diagnose(DiagnosisInput(stalled_window({19, 39, 59, 79, 99}, extra_ms=1000.0), steps_seen=100,
                        system=busy_machine()))
    assert periodic[0].kind == "UNTRACED_WORK" and periodic[0].evidence["period_steps"] == 20


def short_steps_window(slow_steps, extra_ms):
    """300 steps of 0.6 ms (a tiny loop's), the given ones extra_ms longer in untraced time."""
    steps = []
    for index in range(300):
        step = rolled(index, backward=30.0, optimizer=10.0)
        for name in ("step", "forward", "backward", "optimizer", "untraced"):
            setattr(step, f"{name}_ms", getattr(step, f"{name}_ms") * 0.006)
        step.worst_step_ms = step.step_ms
        if index in slow_steps:
            step.step_ms += extra_ms
            step.untraced_ms += extra_ms
        steps.append(step)
    return Window(steps)


def test_cheap_stalls_on_a_period_are_the_scheduler_on_a_busy_machine_and_the_loop_on_a_quiet_one():
    # What a busy loop beside a test did to 0.6 ms steps: three of them a few ms longer in
    # untraced time, 17 steps apart, a few % of the run.
    window = short_steps_window({49, 66, 83}, extra_ms=2.0)
    quiet = diagnose(DiagnosisInput(window, steps_seen=300))
    assert [f.evidence.get("period_steps") for f in quiet if f.kind == "UNTRACED_WORK"] == [17]
    busy = Stalls(window, busy_machine())
    assert busy.cost_share < WARN_COST_SHARE and busy.period is None
    assert not {"UNTRACED_WORK", "STEP_SPIKES"} & set(kinds(diagnose(
        DiagnosisInput(window, steps_seen=300, system=busy_machine()))))
    # Costing more than WARN_COST_SHARE, the period stands, busy machine or not.
    costly = Stalls(short_steps_window({49, 66, 83}, extra_ms=40.0), busy_machine())
    assert costly.cost_share >= WARN_COST_SHARE and costly.period == 17


def planned_window(figure, planned_ms, count=100, step_ms=100.0):
    """Steps of step_ms, mostly forward, with planned work beside them (never in step_ms, as
    the probe records it): figure ("eval" or "checkpoint") -> {step: its ms}."""
    steps = []
    for index in range(count):
        step = rolled(index, backward=30.0, optimizer=10.0)
        for name in ("step", "forward", "backward", "optimizer"):
            setattr(step, f"{name}_ms", getattr(step, f"{name}_ms") * step_ms / 100.0)
        setattr(step, f"{figure}_ms", planned_ms.get(index, 0.0))
        steps.append(step)
    return Window(steps)


def test_checkpoints_are_checkpoint_stall_and_nothing_else():
    window = planned_window("checkpoint", {step: 1000.0 for step in range(19, 100, 20)})
    findings = diagnose(DiagnosisInput(window, steps_seen=100))
    assert [f.kind for f in findings][:2] == ["CHECKPOINT_STALL", "COMPUTE_BOUND"]
    assert "UNTRACED_WORK" not in kinds(findings) and "STEP_SPIKES" not in kinds(findings)
    assert findings[0].summary == ("saved a checkpoint 5 times (every 20 steps): about 1000 ms each: 5.0 s, "
                                   "33.3% of the 15.0 s run")
    assert findings[0].evidence["run_ms"] == 15000.0 and findings[0].evidence["total_ms"] == 5000.0
    assert "async_save" in findings[0].action


def test_evaluation_every_n_steps_is_noted_under_a_compute_bound_verdict():
    window = planned_window("eval", {step: 180.0 for step in range(19, 100, 20)})  # 8% of the run
    findings = diagnose(DiagnosisInput(window, steps_seen=100))
    assert [f.kind for f in findings] == ["COMPUTE_BOUND", "EVAL_HEAVY"]
    assert findings[1].severity == "info" and findings[1].evidence["period_steps"] == 20
    assert findings[1].summary == "evaluated 5 times (every 20 steps): about 180 ms each: 900 ms, 8.3% of the 10.9 s run"


def evaluated_window(evaluations_ms, count=100, step_ms=100.0):
    return planned_window("eval", evaluations_ms, count, step_ms)


def said_ms(evidence):
    """The time a planned-work finding's words account for: the typical one times the count,
    the outliers as named, and what fell outside the windows counted."""
    regular = evidence["count"] - len(evidence["outliers"])
    return regular * evidence["each_ms"] + sum(o["ms"] for o in evidence["outliers"]) + evidence["elsewhere_ms"]


def adds_up(evidence):
    """The words' parts make the total, and the total over the run is the share."""
    return (said_ms(evidence) == pytest.approx(evidence["total_ms"], abs=0.01)
            and evidence["total_ms"] / evidence["run_ms"] == pytest.approx(evidence["share"], abs=1e-4))


def test_an_evaluation_ten_times_slower_is_named_apart_and_keeps_the_period():
    # Every 10 steps an evaluation of 100 ms; the first took 1200 ms (it loaded its data set).
    evaluations = {step: 100.0 for step in range(9, 100, 10)}
    evaluations[9] = 1200.0
    window = evaluated_window(evaluations)
    findings = diagnose(DiagnosisInput(window, steps_seen=100))
    assert [f.kind for f in findings] == ["EVAL_HEAVY", "COMPUTE_BOUND"]
    found = findings[0]
    assert found.evidence["period_steps"] == 10 and found.evidence["count"] == 10
    assert found.evidence["each_ms"] == 100.0 and found.evidence["outliers"] == [{"step": 9, "ms": 1200.0}]
    assert adds_up(found.evidence)
    assert found.summary == ("evaluated 10 times (every 10 steps): 9 of about 100 ms, one of 1200 ms at step 9: "
                             "2.1 s, 17.4% of the 12.1 s run")


def test_a_busy_machine_stretching_some_evaluations_twelve_times_keeps_the_period():
    # The HF Trainer test on a busy machine: 40 steps of about 20 ms and an evaluation after
    # every 10th update, which took 9.8, 14.2 and 1.1 s in one run. Had the last taken 0.8 s, under
    # a tenth of their median, it was dropped as a stray batch and the period went with it.
    evaluations = {9: 9800.0, 19: 14200.0, 29: 800.0}
    window = evaluated_window(evaluations, count=40, step_ms=20.0)
    (found,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=40)) if f.kind == "EVAL_HEAVY"]
    assert found.evidence["period_steps"] == 10 and found.evidence["count"] == 3
    assert adds_up(found.evidence)
    # A stray batch fetched without gradients (a forward alone, under a step) is still none of them.
    evaluations[25] = 12.0
    (found,) = [f for f in diagnose(DiagnosisInput(evaluated_window(evaluations, count=40, step_ms=20.0),
                                                   steps_seen=40)) if f.kind == "EVAL_HEAVY"]
    assert found.evidence["period_steps"] == 10 and found.evidence["count"] == 3


def test_irregular_evaluations_are_counted_all_and_once_is_once():
    # What a field run stored: five evaluations over 996 steps of 15 ms, one of them 458 ms.
    evaluations = dict(zip((120, 310, 500, 730, 905), (68.6, 56.1, 457.6, 42.6, 41.3)))
    window = evaluated_window(evaluations, count=996, step_ms=15.0)
    (found,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=996)) if f.kind == "EVAL_HEAVY"]
    assert found.evidence["count"] == 5 and found.evidence["period_steps"] is None
    assert found.evidence["outliers"] == [{"step": 500, "ms": 457.6}]
    assert adds_up(found.evidence)
    assert found.summary == "evaluated 5 times: 4 of about 52 ms, one of 458 ms at step 500: 666 ms, 4.3% of the 15.6 s run"
    window = evaluated_window({50: 3000.0})
    (found,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=100)) if f.kind == "EVAL_HEAVY"]
    assert found.summary == "evaluated once (at step 50): 3.0 s, 23.1% of the 13.0 s run"
    assert found.evidence["count"] == 1 and found.evidence["outliers"] == [] and found.evidence["first_step"] == 50


def goodput_of(window, evaluation_s, after_last_step_ms, startup_s=1.0, after_last_step_count=1):
    """The run's goodput around a window: startup, its steps, and evaluation_s in all, of which
    after_last_step_ms came after the last step."""
    in_windows_s = sum(s.eval_ms for s in window.steps) / 1e3
    run_s = startup_s + window.total_ms / 1e3 + in_windows_s + (evaluation_s - in_windows_s)
    parts = {part: {"seconds": 0.0, "share": 0.0} for part in PARTS}
    parts["evaluation"] = {"seconds": evaluation_s, "share": evaluation_s / run_s}
    return Goodput(wall_s=run_s, parts=parts, startup={},
                   after_last_step={"evaluation": {"ms": after_last_step_ms, "count": after_last_step_count}})


def test_an_evaluation_after_the_last_step_is_counted_and_what_else_is_outside_the_steps_is_said():
    # Ten evaluations of 100 ms in the steps, and a final one after the last step: goodput holds
    # all of it. A final one like the others is one more of them.
    window = evaluated_window({step: 100.0 for step in range(9, 100, 10)})
    goodput = goodput_of(window, 1.1, 100.0)
    (found,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=100, goodput=goodput)) if f.kind == "EVAL_HEAVY"]
    assert found.evidence["count"] == 11 and found.evidence["after_last_step_ms"] == 100.0 and adds_up(found.evidence)
    assert found.summary == ("evaluated 11 times (every 10 steps, the last after the last step): about 100 ms each: "
                             "1.1 s, 9.1% of the 12.1 s run")
    # A final one ten times longer is named apart; 300 ms more in the warm-up steps are elsewhere.
    goodput = goodput_of(window, 2.3, 1000.0)
    (found,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=100, goodput=goodput)) if f.kind == "EVAL_HEAVY"]
    assert found.evidence["outliers"] == [{"step": None, "ms": 1000.0}] and adds_up(found.evidence)
    assert found.evidence["elsewhere_ms"] == pytest.approx(300.0)
    assert found.summary == ("evaluated 11 times (every 10 steps): 10 of about 100 ms, one of 1000 ms after the last "
                             "step, and 300 ms elsewhere: 2.3 s, 17.3% of the 13.3 s run")
    # Two after the last step (a last one, then a final one), told as two.
    goodput = goodput_of(window, 1.2, 200.0, after_last_step_count=2)
    (found,) = [f for f in diagnose(DiagnosisInput(window, steps_seen=100, goodput=goodput)) if f.kind == "EVAL_HEAVY"]
    assert found.evidence["count"] == 12 and found.evidence["after_last_step_count"] == 2 and adds_up(found.evidence)
    assert found.summary == ("evaluated 12 times (every 10 steps, the last 2 after the last step): about 100 ms each: "
                             "1.2 s, 9.8% of the 12.2 s run")


def test_a_finding_worth_less_than_a_tenth_of_the_run_is_never_the_verdict():
    # Input wait at 9% of the step (a warn at 10%... it is below) and GC at 9.5%: under Also.
    findings = diagnose(DiagnosisInput(window(input_wait=9.0, gc=9.5, backward=30.0), steps_seen=20))
    assert findings[0].kind == "COMPUTE_BOUND"
    below = Finding(kind="INPUT_BOUND", severity="crit", summary="", action="",
                    evidence={"share": VERDICT_SHARE - 0.01})
    healthy = Finding(kind="COMPUTE_BOUND", severity="info", summary="", action="", evidence={"share": 0.8})
    assert [f.kind for f in rank([below, healthy])] == ["COMPUTE_BOUND", "INPUT_BOUND"]


def test_the_ranking_puts_an_oom_first_then_memory_at_risk_then_worth():
    def finding(kind, severity, share, **extra):
        return Finding(kind=kind, severity=severity, summary="", action="",
                       evidence={"share": share, **extra})
    ranked = rank([finding("INPUT_BOUND", "warn", 0.3), finding("UNTRACED_WORK", "crit", 0.2),
                   finding("MEMORY_CREEP", "crit", 0.01), finding("COMPUTE_BOUND", "info", 0.5),
                   finding("MEMORY_PRESSURE", "crit", 1.0, oom=True), finding("GC_PRESSURE", "crit", 0.3)])
    assert [(f.kind, f.severity) for f in ranked] == [
        ("MEMORY_PRESSURE", "crit"), ("MEMORY_CREEP", "crit"), ("GC_PRESSURE", "crit"),
        ("INPUT_BOUND", "warn"), ("UNTRACED_WORK", "crit"), ("COMPUTE_BOUND", "info")]


@pytest.mark.parametrize("found_by, said, not_said", [
    (STEPS_FROM_TRACE_STEP, "outside the trace_step block", "trainer"),
    (STEPS_FROM_OPTIMIZER, "after one update, before the next step's work", "trace_step"),
    (STEPS_FROM_BACKWARD, "includes the update written by hand", "trace_step"),
    ("Lightning (optimizer steps)", "the trainer's own work between updates", "trace_step"),
    ("Hugging Face Trainer (optimizer updates)", "the trainer's own work between updates", "trace_step"),
])
def test_the_words_fit_how_the_steps_were_found(found_by, said, not_said):
    (finding,) = [f for f in diagnose(DiagnosisInput(window(outside=60.0), steps_seen=20, steps_found_by=found_by))
                  if f.kind == "UNTRACED_WORK"]
    assert said in finding.summary
    assert not_said not in finding.summary + finding.action
    if "Trainer" in found_by or "Lightning" in found_by:
        assert "larger batch" in finding.action and "log less often" in finding.action


def test_slow_steps_with_bigger_batches_are_the_loops_not_the_machines():
    # Every 10th batch 8 times larger: forward and backward both grow, as in a machine-wide
    # stall, but the slow steps carry 8x the samples.
    steps = []
    for index in range(100):
        step = rolled(index, backward=30.0, optimizer=10.0)
        if index % 10 == 9:
            step.forward_ms *= 5
            step.backward_ms *= 5
            step.step_ms = step.forward_ms + step.backward_ms + step.optimizer_ms
            step.samples = 64
        steps.append(step)
    findings = diagnose(DiagnosisInput(Window(steps), steps_seen=100))
    spikes = findings[0]
    assert spikes.kind == "STEP_SPIKES" and spikes.evidence["machine_wide"] is False
    assert spikes.evidence["period_steps"] == 10 and spikes.evidence["input_ratio"] == 8.0
    assert "they carry 8.0x the usual step's samples" in spikes.summary and "bucket" in spikes.action


def test_bigger_batches_are_found_by_their_inputs_when_the_machine_jitters():
    window = jittery_window()
    for step in window.steps:
        if step.step % 10 == 9:  # 8x the samples, and the step 2.5x the usual
            step.samples = 64
            step.forward_ms += 300.0
            step.step_ms += 300.0
    stalls = Stalls(window)
    assert stalls.period == 10 and stalls.bigger_inputs and not stalls.machine_wide
    assert diagnose(DiagnosisInput(window, steps_seen=100))[0].kind == "STEP_SPIKES"


def test_a_periodic_input_stall_inside_an_input_bound_run_is_one_finding():
    # Every step waits 40 ms for its data, and every 10th 150 ms more: the stalls are a small part
    # of the input wait the run already has a finding for, not a second INPUT_BOUND.
    steps = []
    for index in range(100):
        step = rolled(index, input_wait=40.0, backward=30.0, optimizer=10.0)
        if index % 10 == 9:
            step.input_wait_ms += 150.0
            step.step_ms += 150.0
        steps.append(step)
    window = Window(steps)
    assert Stalls(window).period == 10 and Stalls(window).phase == "input_wait"
    findings = diagnose(DiagnosisInput(window, steps_seen=100))
    assert [f.kind for f in findings].count("INPUT_BOUND") == 1
    assert findings[0].kind == "INPUT_BOUND" and "STEP_SPIKES" not in kinds(findings)
