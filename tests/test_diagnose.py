"""The step-time rules, on synthetic rolled-up steps, at and around every threshold."""
import pytest

from traceml.collector.rollup import RolledStep, Window, roll_up, warmup_steps
from traceml.diagnose import diagnose
from traceml.diagnose.step_time import (COMPUTE_SHARE, MIN_STEPS, UNTRACED_CRIT_SHARE,
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
    (WAIT_WARN_SHARE - 0.001, None), (WAIT_WARN_SHARE, "warn"), (WAIT_WARN_SHARE + 0.001, "warn"),
    (WAIT_CRIT_SHARE - 0.001, "warn"), (WAIT_CRIT_SHARE, "crit"), (0.6, "crit")])
def test_waiting_rules_at_their_thresholds(phase, kind, share, severity):
    findings = diagnose(window(**{phase: share * 100.0}), steps_seen=20)
    assert kinds(findings).get(kind) == severity


def test_input_bound_states_its_numbers_and_what_to_try():
    (finding,) = [f for f in diagnose(window(input_wait=51.4), steps_seen=20) if f.kind == "INPUT_BOUND"]
    assert finding.summary == "input wait is 51% of the step: 51.4 ms of 100.0 ms"
    assert "num_workers" in finding.action and "pin_memory" in finding.action
    assert finding.evidence["share"] == pytest.approx(0.514)
    assert finding.evidence["phase_mean_ms"] == pytest.approx(51.4)
    assert finding.rank is None


@pytest.mark.parametrize("share,severity", [
    (UNTRACED_WARN_SHARE - 0.001, None), (UNTRACED_WARN_SHARE, "warn"),
    (UNTRACED_CRIT_SHARE - 0.001, "warn"), (UNTRACED_CRIT_SHARE, "crit")])
def test_untraced_work_at_its_thresholds(share, severity):
    # Split between outside and untraced: the rule looks at their sum.
    findings = diagnose(window(outside=share * 60.0, untraced=share * 40.0), steps_seen=20)
    assert kinds(findings).get("UNTRACED_WORK") == severity


def test_untraced_work_names_where_the_time_is():
    outside = [f for f in diagnose(window(outside=40.0), steps_seen=20) if f.kind == "UNTRACED_WORK"][0]
    inside = [f for f in diagnose(window(untraced=40.0), steps_seen=20) if f.kind == "UNTRACED_WORK"][0]
    assert "between steps" in outside.summary and "item()" in outside.action
    assert "inside the step" in inside.summary and "trace_step(model)" in inside.action


@pytest.mark.parametrize("compute,expected", [(COMPUTE_SHARE - 0.001, False), (COMPUTE_SHARE, True),
                                              (0.95, True)])
def test_compute_bound_when_the_model_dominates(compute, expected):
    # Compute = forward (the rest) + 10 ms backward; the remainder is outside.
    outside = 100.0 - compute * 100.0
    findings = diagnose(window(outside=outside, backward=10.0), steps_seen=20)
    assert ("COMPUTE_BOUND" in kinds(findings)) is expected
    if expected:
        finding = [f for f in findings if f.kind == "COMPUTE_BOUND"][0]
        assert finding.severity == "info"
        assert "autocast" in finding.action


def test_a_healthy_compute_bound_run_has_it_as_primary():
    findings = diagnose(window(input_wait=2.0, outside=3.0, untraced=5.0, backward=40.0), steps_seen=20)
    assert [f.kind for f in findings] == ["COMPUTE_BOUND"]


def test_primary_is_the_most_severe_then_the_most_costly():
    findings = diagnose(window(input_wait=25.0, h2d=12.0, outside=35.0), steps_seen=20)
    assert [(f.kind, f.severity) for f in findings] == [
        ("INPUT_BOUND", "crit"), ("UNTRACED_WORK", "warn"), ("H2D_BOUND", "warn")]


def test_every_window_gets_a_verdict():
    # Nothing above a threshold alone: 9% input, 9% h2d, 49% compute leaves 33% untraced.
    findings = diagnose(window(input_wait=9.0, h2d=9.0, outside=33.0), steps_seen=20)
    assert findings and findings[0].kind == "UNTRACED_WORK"


@pytest.mark.parametrize("steps_seen,insufficient", [(MIN_STEPS - 1, True), (MIN_STEPS, False)])
def test_insufficient_data_below_ten_steps(steps_seen, insufficient):
    findings = diagnose(window(count=steps_seen, input_wait=50.0), steps_seen=steps_seen)
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
from traceml.diagnose.spikes import step_spikes
from traceml.diagnose.step_time import GC_CRIT_SHARE, GC_WARN_SHARE
from traceml.records import OomRecord


@pytest.mark.parametrize("share,severity", [(GC_WARN_SHARE - 0.001, None), (GC_WARN_SHARE, "warn"),
                                            (GC_CRIT_SHARE - 0.001, "warn"), (GC_CRIT_SHARE, "crit")])
def test_gc_pressure_at_its_thresholds(share, severity):
    findings = diagnose(window(gc=share * 100.0), steps_seen=20)
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
    found = step_spikes(spiky_window(period=20, phase="outside"))
    assert found.evidence["period_steps"] == 20 and found.evidence["phase"] == "outside"
    assert found.evidence["spikes"] == 5 and "every 20 steps" in found.summary
    assert found.evidence["share"] == pytest.approx(600.0 / 10600.0, rel=1e-3)


def test_rare_irregular_hiccups_are_not_a_finding():
    assert step_spikes(spiky_window(at=(13, 58, 91))) is None  # 3 irregular, 3.5% of the time
    assert step_spikes(Window([rolled(i) for i in range(100)])) is None


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


def test_creep_gives_bytes_per_step_and_the_step_memory_runs_out():
    found = memory_creep(memory_window([1024 * MIB + i * 2 * MIB for i in range(50)]),
                         MemoryLimits(device_capacity_bytes=2048 * MIB))
    assert found.evidence["bytes_per_step"] == pytest.approx(2 * MIB)
    # 1024 + 98 MiB held at step 49; (2048 - 1122) / 2 = 463 steps more.
    assert found.evidence["projected_oom_step"] == 49 + 463
    assert "runs out near step 512" in found.summary


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
    findings = diagnose(window(count=3), steps_seen=3, oom=oom,
                        limits=MemoryLimits(device_capacity_bytes=80 * 2 ** 30))
    assert [f.kind for f in findings] == ["MEMORY_PRESSURE", "INSUFFICIENT_DATA"]
    assert "in backward, inside layer blocks.2.mlp" in findings[0].summary
    assert "79.00 GiB allocated of 80.00 GiB" in findings[0].summary
    assert out_of_memory(oom, MemoryLimits()).evidence["oom"] is True
