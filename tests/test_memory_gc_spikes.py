"""Memory creep, GC pressure and step spikes on real CPU loops, and a healthy run free of them."""
import json

from conftest import wide_mlp
from traceml.analysis.rollup import Window, roll_up
from traceml.records import warmup_steps
from traceml.collector.store import Store
from traceml.diagnose.memory import MIN_GROWTH_BYTES, MemoryLimits, memory_creep

LONG_RUN_FINDINGS = {"MEMORY_CREEP", "GC_PRESSURE", "STEP_SPIKES", "MEMORY_PRESSURE"}


def kinds(summary):
    return {f["kind"]: f for f in summary["findings"]}


def test_keeping_loss_and_activations_is_memory_creep_with_a_forecast(traceml_run):
    # 40 ms between steps: host RSS is read every 20 ms, so the first 50 steps hold a fresh
    # reading for every step even when the machine is busy (at 10 ms a busy CI run once left
    # too few in the first 50 for the early forecast; at 20 ms another went 650 ms, 16 steps,
    # without a new reading, and the middle of the window looked flat). One intra-op thread, as
    # in test_deep_dive's GPT test: one thread fewer to compete with the sender's on a busy machine.
    # --retain-graph: each kept graph holds its saved activations (~8 MiB of RSS a step), a leak RSS
    # shows step by step. The kept loss and outputs alone are ~20 KiB a step: what RSS showed of
    # them was the heap fragmenting around them, which glibc's allocator paused for a second or
    # more at times by filling old holes (the collector's own RSS samples were flat too), and a
    # flat third of the early window is no persistent trend.
    run = traceml_run("--steps", 60, "--no-loader", "--keep-graph", "--retain-graph", "--batch-size", 512,
                      "--features", 256, "--width", 1024, "--outside-ms", 40)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    creep = kinds(summary)["MEMORY_CREEP"]
    assert creep["evidence"]["bytes_per_step"] >= 2 ** 19  # each step leaves its graph behind
    assert creep["evidence"]["measured_on"] == "host_rss"
    assert creep["evidence"]["projected_oom_step"] > 60
    assert "loss.item()" in creep["action"] and "retain_graph=True" in creep["action"]
    # The kept graphs are none of the ledger's parts: parameters, gradients, optimizer state and
    # the sampled step's activations stay as they were.
    assert creep["evidence"]["growing_part"] == "rest" and "stay flat" in creep["summary"]
    assert summary["memory"]["creep_bytes_per_step"] == creep["evidence"]["bytes_per_step"]

    # Detected early: the first 50 steps are enough.
    store = Store(str(run.run_dir / "telemetry.sqlite"))
    rolled = roll_up(store.steps())[:50]
    early = memory_creep(Window(rolled[warmup_steps(50):]), MemoryLimits(host_available_bytes=2 ** 34))
    assert early is not None and early.evidence["bytes_per_step"] >= 2 ** 19


def test_collecting_a_large_heap_every_step_is_gc_pressure(traceml_run):
    run = traceml_run("--steps", 14, "--no-loader", "--gc-heap", 1_500_000)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    primary = summary["primary_diagnosis"]
    assert primary["kind"] == "GC_PRESSURE" and primary["severity"] == "crit"
    assert primary["evidence"]["collections_per_step"] >= 1.0
    assert primary["evidence"]["worst_pause_ms"] >= primary["evidence"]["median_pause_ms"] > 5.0
    assert "gc.freeze()" in primary["action"]
    assert primary["evidence"]["full_collection_share"] > 0.9  # gc.collect() is a full collection
    assert summary["phases"]["gc"]["share"] > 0.5


def test_a_save_every_20th_step_is_one_checkpoint_finding_with_its_period(traceml_run):
    run = traceml_run("--steps", 120, "--no-loader", "--save-every", 20, "--save-mb", 48)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    found = kinds(summary)
    stall = found["CHECKPOINT_STALL"]
    assert stall["evidence"]["period_steps"] == 20 and stall["evidence"]["count"] == 6
    assert stall["summary"].startswith("saved a checkpoint 6 times (every 20 steps): ")
    assert "async_save" in stall["action"]
    # One cause, one finding: neither the saves' slow steps nor the untraced time they make are
    # told again. Other slow steps may be (after a save this loop sometimes runs ~20x slower in
    # backward until the next save): another finding, never the saves' period again. A busy
    # machine stalls all steps, the saves' too: that is told as the machine's, under Also. The
    # loop's own work around its sub-ms phases may be UNTRACED_WORK (no save dilutes the steps
    # now), never with the saves in it.
    untraced = found.get("UNTRACED_WORK")
    assert untraced is None or untraced["evidence"]["phase_mean_ms"] < stall["evidence"]["each_ms"] / 20, untraced
    spikes = found.get("STEP_SPIKES")
    assert spikes is None or spikes["evidence"]["machine_wide"] or spikes["evidence"].get("period_steps") != 20, spikes
    if stall["evidence"]["share"] >= 0.10:
        assert summary["primary_diagnosis"]["kind"] == "CHECKPOINT_STALL"
    # Inside the step, the save is beside the step's time, not in its untraced time.
    saves = [row for row in run.step_rows() if row["checkpoint_ms"] > 0]
    assert [row["step"] for row in saves] == list(range(19, 120, 20))
    assert all(row["untraced_ms"] < row["checkpoint_ms"] / 2 for row in saves)


@wide_mlp
def test_a_flat_healthy_run_has_none_of_these(wide_mlp_run):
    # test_end_to_end's compute-bound run (conftest.WIDE_MLP): 80 steps of a wide MLP fed from memory.
    run = wide_mlp_run
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    found = {f["kind"]: f for f in summary["findings"]}
    if "STEP_SPIKES" in found:  # allowed only as what it is on a busy machine: the machine's
        assert found["STEP_SPIKES"]["evidence"]["machine_wide"], found["STEP_SPIKES"]
    assert not (LONG_RUN_FINDINGS - {"STEP_SPIKES"}) & set(found), summary["findings"]
    assert summary["primary_diagnosis"]["kind"] == "COMPUTE_BOUND"


def test_tracemls_own_memory_never_reads_as_the_users_creep(traceml_run):
    # 12000 sub-millisecond steps: TraceML's own memory (the steps kept for traceml.summary(),
    # the ring of ended steps) is host RSS too. Kept as StepRecords, the latest 8192 steps grew
    # a healthy loop by 7 MiB after its first 1000 steps, which the rule read as creep.
    run = traceml_run("--steps", 12000, "--no-loader", "--print-summary", timeout=240)
    assert run.returncode == 0, run.stderr
    rss = {row["step"]: row["host_rss_bytes"] for row in run.step_rows()}
    assert len(rss) == 12000
    grown = max(rss[step] for step in range(11000, 12000)) - rss[1000]
    # Under the rule's floor with room: the frames kept (0.7 MiB) and the allocators' warm-up.
    assert grown < 0.75 * MIN_GROWTH_BYTES, f"TraceML held {grown / 2 ** 20:.1f} MiB more at the end"
    assert "MEMORY_CREEP" not in kinds(run.summary())
    # traceml.summary() in the process still saw the latest steps, from the frames kept.
    line = next(line for line in run.stdout.splitlines() if line.startswith("SUMMARY "))
    printed = json.loads(line[len("SUMMARY "):])
    assert printed["traceml/steps"] >= 4096, printed
