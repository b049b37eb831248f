"""The compiled timers (probe/_fastpath.c) against the Python patches they stand in for: built
and used where a compiler is, the same figures on every shape of loop, and a fault in their
bookkeeping costs a figure, never the user's call."""
import collections
import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest
from conftest import SCRIPTS

from traceml.probe import step_state

# The tests of the compiled timers themselves; the rest here hold for whichever path runs, and
# run again with TRACEML_NO_FASTPATH=1 in CI's Python pass (see the README's test command).
compiled = pytest.mark.skipif(sys.platform != "linux" or step_state.python_timers_asked(),
                              reason="the compiled timers are built on Linux and macOS, and not turned off")
# Tests that choose the path of each process they start: the Python pass would repeat them.
chooses_its_paths = pytest.mark.skipif(step_state.python_timers_asked(),
                                       reason="chooses each run's timers itself: run once, in the main pass")


def shapes_loop(tmp_path, script="shapes_loop.py", **env):
    tmp_path.mkdir()
    result = subprocess.run([sys.executable, str(SCRIPTS / script)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path,
                            env=dict(os.environ, TRACEML_RUN_DIR=str(tmp_path / "run"), **env))
    assert result.returncode == 0, result.stderr
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


@compiled
@pytest.mark.parametrize("value, compiled_used", [("0", True), ("", True), ("1", False), ("yes", False)])
def test_the_switch_turns_the_compiled_timers_off_only_when_set(value, compiled_used):
    probe = subprocess.run([sys.executable, "-c", "from traceml.probe import step_state; print(step_state.fast_path is not None)"],
                           capture_output=True, text=True, timeout=60, env=dict(os.environ, TRACEML_NO_FASTPATH=value))
    assert probe.stdout.split() == [str(compiled_used)], probe.stderr


@compiled
def test_the_compiled_timers_are_built_and_used():
    from traceml.probe import step, step_state

    assert step_state.fast_path is not None, "the C fast path did not build or load (see setup.py)"
    assert step.StepProbe.__mro__[1] is step_state.fast_path.ProbeState


def test_the_step_layout_is_declared_once_and_the_build_says_it_back():
    """layout.py declares the slots and the probe's state; setup.py writes the C header from it;
    the module says back what it was built from, and the objects it makes by position, and
    step.py checks each. The Python state has the same fields as the C struct."""
    from pathlib import Path

    from traceml.probe import _fastpath, layout, step_state
    from traceml.records import TIMED_PHASES

    probe_dir = Path(layout.__file__).parent
    assert (probe_dir / "_layout.h").read_text() == layout.c_header()  # the header is the table's
    slots, window, closed, ended, state = _fastpath.LAYOUT
    assert slots == tuple(name for name, _ in layout.STEP_SLOTS) and window == layout.WINDOW_SLOTS
    assert closed == step_state.ClosedStep.__struct_fields__ == layout.CLOSED_STEP_FIELDS
    assert ended == step_state.EndedWindow.__struct_fields__ == layout.ENDED_WINDOW_FIELDS
    assert state == tuple(name for name, _ in layout.STATE_FIELDS)
    assert set(state) <= set(step_state.PythonProbeState.__slots__)
    assert set(state) <= set(dir(_fastpath.ProbeState))
    assert step_state.STEP_ZEROS[step_state.FAILED_PHASE] == layout.NO_PHASE == step_state.NO_PHASE
    assert [step_state.H2D, step_state.FORWARD, step_state.BACKWARD, step_state.OPTIMIZER] == [
        slots.index(phase) for phase in TIMED_PHASES]


ADDED_SLOTS_STEPS = """
import json, sys
from traceml.probe import step, step_state
from traceml.probe.sender import Sender
from traceml.records import RankHello
from traceml.probe.step import StepProbe

python_ends = []
python_exit = StepProbe.exit
StepProbe.exit = lambda self, *args, **kwargs: python_ends.append(self.step_index) or python_exit(self, *args, **kwargs)
hello = RankHello(rank=0, local_rank=0, world_size=1, node_rank=0, host="h", pid=1, device="cpu", device_name="cpu",
                  device_capacity_bytes=None, torch_version="2.13.0", argv=["train.py"], started_at_unix_s=1.0)
sender = Sender(hello, address="127.0.0.1:1", feed_of=StepProbe)  # never started: nothing drains
probe = sender.feed
probe.due_step = float("inf")  # no work due at a start: the compiled path's steps
slot = step_state.step_slot
for index in range(3):
    probe.window[step_state.window_slot("added_window_ns")] += 100 + index
    with probe:
        probe.sums[step_state.FORWARD] += 1_000 + index
        probe.sums[slot("added_in_the_middle")] += 10 + index
        probe.sums[slot("added_object_in_the_middle")] = ["middle", index]
        probe.sums[slot("added_at_the_end")] += 20 + index
        probe.sums[slot("added_object_at_the_end")] = ("end", index)
        probe.sums[step_state.TOKENS] += 30 + index
with probe:
    pass
ended, dropped = probe.take_ended()
records = [sender.steps.record_from(ending) for ending in ended]
clock_fields = ("start_unix_s", "step_ms", "untraced_ms", "outside_ms", "cpu_wait_ms", "on_cpu_ms")
print(json.dumps({
    "compiled": step_state.fast_path is not None, "ended_in_python": python_ends, "dropped": dropped,
    "sums": [list(ending.closed.sums) for ending in ended], "windows": [ending.window for ending in ended],
    "records": [{name: getattr(record, name) for name in record.__struct_fields__ if name not in clock_fields}
                for record in records]}, default=list))
"""


@compiled
def test_slots_added_to_the_layout_reach_the_record_alike_by_the_compiled_and_python_paths(tmp_path):
    """On a copy of the package, slots are added to layout.py (an int and an object in the middle
    of the step's list and at its end, an int in the window's), the C is built from it, and
    steps run through the compiled path and the Python path: the same lists and records."""
    import shutil
    from pathlib import Path

    root = Path(__file__).parents[1]
    shutil.copytree(root / "src", tmp_path / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(root / name, tmp_path)
    layout_py = tmp_path / "src" / "traceml" / "probe" / "layout.py"
    text = layout_py.read_text()
    for old, new in (('    ("tokens", 0),\n', '    ("tokens", 0),\n    ("added_in_the_middle", 0),\n'
                                                '    ("added_object_in_the_middle", None),\n'),
                     ('    ("failed_phase", NO_PHASE),\n', '    ("failed_phase", NO_PHASE),\n'
                                                          '    ("added_at_the_end", 0),\n'
                                                          '    ("added_object_at_the_end", None),\n'),
                     ('    "input_wait_gap_ns",\n)', '    "input_wait_gap_ns",\n    "added_window_ns",\n)')):
        assert old in text
        text = text.replace(old, new)
    layout_py.write_text(text)
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0 and list((tmp_path / "src" / "traceml" / "probe").glob("_fastpath*")), built.stderr
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "src"))
    outcomes = []
    for switch in ("0", "1"):
        result = subprocess.run([sys.executable, "-c", ADDED_SLOTS_STEPS], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path, env=dict(env, TRACEML_NO_FASTPATH=switch))
        assert result.returncode == 0, result.stderr
        outcomes.append(json.loads(result.stdout.splitlines()[-1]))
    compiled, python = outcomes
    assert compiled["compiled"] and compiled["ended_in_python"] == []  # the C built from the new layout ended them
    assert not python["compiled"] and python["ended_in_python"] == [0, 1, 2, 3]
    assert compiled["sums"] == python["sums"] and compiled["windows"] == python["windows"]
    assert compiled["records"] == python["records"] and len(compiled["records"]) == 3
    # after tokens (slot 7): the two added in the middle, then comm_wait_ns
    assert [sums[8:11] for sums in compiled["sums"]] == [[10 + i, ["middle", i], 0] for i in range(3)]
    assert [sums[-2:] for sums in compiled["sums"]] == [[20 + i, ["end", i]] for i in range(3)]
    assert [window[-1] for window in compiled["windows"]] == [101, 102, 0]
    assert [record["tokens"] for record in compiled["records"]] == [30, 31, 32]


ANOTHER_LAYOUT = """
import sys
from traceml.probe import layout
window = list(layout.WINDOW_SLOTS)
window[7], window[8] = window[8], window[7]  # eval and checkpoint swapped since the build
layout.WINDOW_SLOTS = tuple(window)
from traceml.probe import step, step_state
print("compiled", step_state.fast_path is not None, "eval slot", step_state.EVAL_NS)
"""


@compiled
def test_a_build_from_another_layout_is_not_used(tmp_path):
    result = subprocess.run([sys.executable, "-c", ANOTHER_LAYOUT], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "compiled False eval slot 8" in result.stdout


@compiled
def test_compiled_and_python_timers_agree_on_every_shape(tmp_path):
    compiled = shapes_loop(tmp_path / "c")
    python = shapes_loop(tmp_path / "p", TRACEML_NO_FASTPATH="1")
    assert python["compiled"] is False
    assert compiled["compiled"] is (sys.platform in ("linux", "darwin"))
    # Per step: samples, forward calls, and which phases were timed, for 12 DataLoader steps
    # over two epochs (a short last batch), LBFGS closures, kwargs-only calls, manual SGD.
    assert compiled["steps"] == python["steps"]
    assert len(compiled["steps"]) == 20
    assert [row[1] for row in compiled["steps"][:12]] == [4, 4, 4, 4, 4, 1] * 2
    assert compiled["sums_ok"] and python["sums_ok"]  # the parts add up to each step
    assert compiled["eval_between_steps"] == python["eval_between_steps"] > 0


def spans_and_scalars(run_dir):
    with sqlite3.connect(run_dir / "telemetry.sqlite") as db:
        spans = db.execute("SELECT step, name, count FROM spans ORDER BY step, name").fetchall()
        scalars = db.execute("SELECT step, name, round(value, 6) FROM scalars ORDER BY step, name").fetchall()
    return spans, scalars


@compiled
def test_compiled_and_python_agree_on_inferred_steps_spans_and_scalars(tmp_path):
    compiled = shapes_loop(tmp_path / "c", script="inferred_shapes_loop.py")
    python = shapes_loop(tmp_path / "p", script="inferred_shapes_loop.py", TRACEML_NO_FASTPATH="1")
    assert compiled["compiled"] is (sys.platform in ("linux", "darwin")) and python["compiled"] is False
    assert compiled["steps"] == python["steps"]
    assert compiled["sums_ok"] and python["sums_ok"]
    steps = compiled["steps"]
    # 5 updates of two micro-batches, then the GAN's turns (its optimizers take over from the
    # first one, which stopped), then the second region's 10 batches, each its own step.
    assert [row[1:3] for row in steps[:5]] == [[8, 2]] * 5
    assert [row[1:3] for row in steps[-10:]] == [[4, 1]] * 10
    assert len(steps) == 18 and [row[0] for row in steps] == list(range(18))
    spans, scalars = spans_and_scalars(tmp_path / "c" / "run")
    assert (spans, scalars) == spans_and_scalars(tmp_path / "p" / "run")
    calls = {}
    for step, name, count in spans:
        calls[name] = calls.get(name, 0) + count
    assert calls == {"update": 5, "compute": 20, "failing": 5}  # a span left by an exception counts too
    logged = {}
    for step, name, value in scalars:
        logged.setdefault(name, []).append((step, value))
    assert logged["index"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert logged["flag"] == [(0, 1.0), (1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0)]
    assert logged["keyword"] == logged["index"] and len(logged["loss"]) == 15
    assert "huge" not in logged  # too large for a float: dropped, the loop unharmed
    assert len({step for step, _ in logged["generator_loss"]}) == 3  # the GAN's updates made steps


BROKEN_STEP = """
import json, torch, traceml
from torch import nn
from traceml.probe import step, step_state
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for broken in (False, True):
    with traceml.trace_step(model):
        if broken:  # the step's sums are no list of ints: every timer's addition fails
            step._probe.sums = None
            faults_before = step_state.fast_path.faults()
        loss = model(torch.ones(3, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(json.dumps({"faults": step_state.fast_path.faults() - faults_before, "grad": model.weight.grad is not None}))
"""


@compiled
def test_a_fault_in_the_bookkeeping_costs_the_figure_not_the_call(tmp_path):
    result = subprocess.run([sys.executable, "-c", BROKEN_STEP], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=dict(os.environ, TRACEML_RUN_DIR=str(tmp_path / "run")))
    assert result.returncode == 0, result.stderr  # the user's steps ran whole
    outcome = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    # Forward's counts and its time, backward's and the optimizer's: each failed once, counted,
    # and said once at the end, on stderr, not in the user's output.
    assert outcome == {"faults": 4, "grad": True}
    assert "4 phase timings were lost to internal errors" in result.stderr


def _step_records(probe, items):
    """The step records among what reached the sender: made from the ring by the compiled path,
    or by record_from from the EndedWindows of Python's path."""
    from traceml.probe.step_state import EndedWindow
    from traceml.records import StepRecord

    from traceml.probe.step_records import StepRecords

    return [item if type(item) is StepRecord else StepRecords(probe).record_from(item) for item in items
            if type(item) in (StepRecord, EndedWindow)]


def test_a_full_buffer_drops_and_counts_each_new_record_and_each_sender_has_its_own():
    """The compiled end queues each step in the probe's ring as numbers, the Python end as an
    EndedWindow; the sender's round moves them to its buffer as StepRecords. Either way, once the steps
    waiting and the buffer's records fill the sender's capacity each new step is dropped and
    counted, never waited for, and each probe and sender has its own."""
    from test_records import hello

    from traceml.probe.sender import Sender
    from traceml.probe.step import StepProbe

    for capacity, held in ((3, 0), (5, 0), (5, 2)):
        # never started: nothing drains
        sender = Sender(hello(), capacity=capacity, address="127.0.0.1:1", feed_of=StepProbe)
        probe = sender.feed
        for _ in range(held):  # records already waiting in the buffer take their room
            sender.push(("a span", None))
        for _ in range(10):
            with probe:
                pass
        sender._take_ended_steps()  # what the sender's round does
        # Each start after the first ends the step before: 9 windows ended, the last still open.
        # Whichever path ended them, what waits (steps and the rest) never exceeds the capacity.
        assert len(sender._buffer) == capacity
        steps = capacity - held
        assert [record.step for record in _step_records(probe, sender._buffer)] == list(range(steps))
        assert sender.records_dropped == 9 - steps


def test_steps_ended_by_either_path_reach_the_sender_in_order_with_their_figures():
    """Plain steps end in the compiled path (as numbers), the others in Python (as objects):
    both join one queue, so the sender gets every step once, in order, each window ending
    where the next step starts, and the figures the patches summed."""
    from test_records import hello

    from traceml.probe.sender import Sender
    from traceml.probe.step_state import EVAL_NS, FORWARD
    from traceml.probe.step import StepProbe

    sender = Sender(hello(), address="127.0.0.1:1", feed_of=StepProbe)
    probe = sender.feed
    starts_ns, failed_start_ns = [], None
    for step in range(12):
        if step == 4:
            probe.due_step = 4  # from here on each start goes through Python's long path
        if step == 8:
            probe.due_step = float("inf")  # and back to the short one
        probe.window[EVAL_NS] += 100 + step  # as the model's patch adds between steps
        with probe:
            starts_ns.append(probe._step_start_ns)
            probe.sums[FORWARD] += 5_000 + step  # as the model's patch adds
        if step == 6:
            with pytest.raises(ValueError):
                with probe:  # a step that fails is not a step: its window never closes
                    failed_start_ns = probe._step_start_ns
                    raise ValueError("user's error")
    probe.finish()
    sender._take_ended_steps()
    records = _step_records(probe, sender._buffer)
    assert [record.step for record in records] == list(range(12))
    assert [record.forward_ms for record in records] == [(5_000 + step) / 1e6 for step in range(12)]
    # A window holds what ran between its step and the next start, the evaluation beside the
    # step's time; step 6's ended where the failed step started, and what ran after that one is
    # no step's.
    assert [record.eval_ms for record in records] == [
        0.0 if step in (6, 11) else (100 + step + 1) / 1e6 for step in range(12)]
    ends_ns = starts_ns[1:]
    ends_ns[6] = failed_start_ns
    assert [record.step_ms + record.eval_ms for record in records[:-1]] == pytest.approx([
        (end - start) / 1e6 for start, end in zip(starts_ns, ends_ns)], abs=1e-9)
    assert [record.start_unix_s for record in records] == [probe.unix_s(start) for start in starts_ns]


def test_a_step_keeps_every_figure_on_its_way_to_the_sender(monkeypatch):
    """The compiled end copies a plain step's figures out of its lists (then zeroed for the next
    step) and the sender's thread makes its StepRecord by record_from: each figure lands in its
    own field. Where the compiled timers are used, the step takes their path (StepProbe.exit,
    Python's end, never runs); on the Python path, it does."""
    from types import SimpleNamespace

    from test_records import hello

    from traceml.probe.sender import Sender
    from traceml.probe.step_state import REAL_TOKENS, TOKEN_COPIES
    from traceml.probe.step import StepProbe
    from traceml.probe.thread_cpu import ThreadCpu

    sender = Sender(hello(), address="127.0.0.1:1", thread_cpu=ThreadCpu.of_this_thread(),
                    feed_of=lambda sender: StepProbe(sender, host_rss=SimpleNamespace(latest_bytes=123_456_789)))
    probe = sender.feed
    ended_by_python = []
    python_exit = StepProbe.exit
    monkeypatch.setattr(StepProbe, "exit", lambda self, *args, **kwargs: ended_by_python.append(self.step_index)
                        or python_exit(self, *args, **kwargs))
    probe.due_step = float("inf")  # no work due at the next start (the ledger's first reading)
    ms = 1_000_000
    with probe:
        start_ns = probe._step_start_ns
        assert probe.plain  # no deep-dive, no collective wait timed: the step the compiled path ends
        # h2d, forward, backward, optimizer, input wait inside, forward calls, samples, tokens (a plain
        # step times no collective wait: those slots stay 0)
        for index, value in enumerate([1 * ms, 2 * ms, 3 * ms, 4 * ms, 5 * ms, 6, 7, 8]):
            probe.sums[index] += value
        probe.sums[REAL_TOKENS] = 10
        time.sleep(0.02)  # the step outlasts its phases: the rest is untraced
    # gc ns, collections, longest, full, gen 0, 1, 2, eval, checkpoint, compile, saves between, input wait gap
    for index, value in enumerate([11 * ms, 12, 13 * ms, 14, 15 * ms, 16 * ms, 17 * ms, 18 * ms, 19 * ms, 20 * ms,
                                   0, 1]):
        probe.window[index] += value
    with probe:
        window_end_ns = probe._step_start_ns
        assert probe.sums[:TOKEN_COPIES] == [0] * REAL_TOKENS + [None] and probe.window == [0] * len(probe.window)
    sender._take_ended_steps()
    (record,) = _step_records(probe, sender._buffer)
    assert ended_by_python == ([] if step_state.fast_path is not None else [0, 1])  # the path this build takes
    fields = {name: getattr(record, name) for name in record.__struct_fields__}
    untraced_ms, outside_ms = fields.pop("untraced_ms"), fields.pop("outside_ms")
    # Stamped by the sender from this thread's counts (Linux), within the step.
    for name in ("cpu_wait_ms", "on_cpu_ms"):
        figure = fields.pop(name)
        assert (figure is None) if not sys.platform.startswith("linux") else 0.0 <= figure <= fields["step_ms"] + 0.001
    assert fields == dict(
        rank=0, step=0, start_unix_s=probe.unix_s(start_ns),
        step_ms=pytest.approx(15.0 + 1e-6 + untraced_ms + outside_ms, abs=1e-9),  # its phases
        input_wait_ms=(5 * ms + 1) / 1e6, h2d_ms=1.0, forward_ms=2.0, backward_ms=3.0, optimizer_ms=4.0,
        gc_ms=11.0, gc_collections=12, forward_calls=6, samples=7, device_timed=False, gpu_idle_ms=None,
        device_allocated_bytes=None, device_peak_bytes=None, device_reserved_bytes=None,
        host_rss_bytes=123_456_789, comm_wait_ms=None, gc_max_pause_ms=13.0, gc_full_collections=14,
        gc_gen0_ms=15.0, gc_gen1_ms=16.0, gc_gen2_ms=17.0, tokens=8, real_tokens=10, eval_ms=18.0,
        checkpoint_ms=19.0, instrumented=False, compile_ms=20.0, forward_comm_wait_ms=0.0,
        optimizer_comm_wait_ms=0.0)
    # The step's end splits the rest: untraced inside the block, outside after it; the planned
    # work is beside the step, as much of it as the block's rest (the save) and the gap after it
    # (the evaluation) held: at least the 5 ms the block outlasted its phases.
    assert untraced_ms >= 0.0 and outside_ms >= 0.0
    assert 20.0 - 15.0 <= (window_end_ns - start_ns) / 1e6 - fields["step_ms"] <= 18.0 + 19.0


class _FullSender:
    """A sender with no room: every span total goes through its own push_span, in Python."""

    capacity, ledger = 0, None

    def __init__(self, on_push):
        self._buffer, self._spans = collections.deque(), collections.deque()
        self.pushed, self.on_push = [], on_push

    def push_span(self, ended):
        self.pushed.append(ended)
        self.on_push()


def test_a_span_total_goes_to_the_probes_dict_as_it_is_after_a_full_buffers_push():
    """A span's call in a later step hands the earlier total to the sender; with the buffer full
    that is the sender's push_span, in Python, where another thread may swap the probe's dict
    of totals (flush_spans at the run's end). The new total goes to the dict the probe holds
    then (as span_done does), never to the one it let go of."""
    from traceml.probe.step import StepProbe
    from traceml.probe.tracer import Trace

    sender = _FullSender(on_push=lambda: setattr(probe, "span_totals", {}))  # the old dict is freed here
    probe = StepProbe(sender)
    tracer = Trace()
    tracer._probe = probe
    with tracer.span("load"):
        pass
    probe.step_index = 2  # a later step: its first call hands step 1's total over
    with tracer.span("load"):
        pass
    assert [(name, total.step, total.calls) for name, total in sender.pushed] == [("load", 0, 1)]
    assert [(name, total.step, total.calls) for name, total in probe.span_totals.items()] == [("load", 1, 1)]
    assert step_state.fast_path is None or step_state.fast_path.faults() == 0


def test_a_step_dropped_while_the_sender_takes_the_steps_is_counted():
    """The sender's thread takes the ended steps and how many were dropped; making what it
    returns can run the garbage collector, whose callbacks (or the training thread, meanwhile)
    may drop another step on a full buffer. That drop is counted in this call or the next,
    never lost. With a collection on nearly every allocation, each collection drops one."""
    import gc

    from traceml.probe.step import StepProbe

    probe = StepProbe(_FullSender(on_push=lambda: None))
    made = []

    def drop_one(phase, info):
        if phase == "start":
            probe.publish_ended(None)  # the buffer is full: dropped and counted, never looked at
            made.append(phase)

    threshold, taken = gc.get_threshold(), []
    gc.set_threshold(1)
    gc.callbacks.append(drop_one)
    try:
        for _ in range(300):
            taken.append(probe.take_ended())  # kept: their tuples stay off the free list
    finally:
        gc.callbacks.remove(drop_one)
        gc.set_threshold(*threshold)
    taken.append(probe.take_ended())
    assert made and sum(dropped for steps, dropped in taken) == len(made)
    assert not any(steps for steps, dropped in taken)


def test_a_probe_lets_its_sender_go():
    """Once a probe and its sender are dropped nothing keeps the sender alive (its buffer,
    its queues), whichever path pushed to it last: steps, a span's total and a scalar."""
    import gc
    import weakref

    from test_records import hello

    from traceml.probe.sender import Sender
    from traceml.probe.step import StepProbe
    from traceml.probe.tracer import Trace

    sender = Sender(hello(), address="127.0.0.1:1", feed_of=StepProbe)
    tracer = Trace()
    tracer._probe = probe = sender.feed
    for _ in range(3):
        with probe:
            with tracer.span("load"):
                pass
        tracer.log_scalar("loss", 1.5)
    sender._take_ended_steps()
    assert len(sender._buffer) >= 3 and len(sender._spans) == 2
    gone = weakref.ref(sender)
    del sender, probe, tracer
    gc.collect()
    assert gone() is None


@compiled
def test_the_models_call_runs_when_its_timer_has_no_memory_for_its_bookkeeping():
    """The model's timer makes one object before it knows whether the model is traced (its key
    in the traced models); without memory for it, the call still runs (through Python's patch)
    and the fault costs the figure only."""
    import _testcapi

    from traceml.probe.step_state import fast_path

    ran = []

    def original(model, batch):  # the user's model's call
        ran.append(batch)
        return "output"

    def general(model, *args, **kwargs):  # Python's patch: calls the original for an untraced model
        return original(model, *args, **kwargs)

    timer = fast_path.Timer(fast_path.MODEL_CALL, original, general, models={})
    model, faults = object(), fast_path.faults()
    _testcapi.set_nomemory(0, 1)  # the next allocation fails: the timer's key of the model
    try:
        output = timer(model, "batch")
    finally:
        _testcapi.remove_mem_hooks()
    assert (output, ran) == ("output", ["batch"])
    assert fast_path.faults() == faults + 1


SPAN_TIMES = """
import json, time, torch, traceml
from torch import nn
from traceml.probe import step, step_state
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
tracer = traceml.Trace()
own = {}  # (step, name) -> [first start (wall s), ms summed, calls], by the script's own clock
with tracer.trace("spans"):
    for index in range(6):
        loss = model(torch.ones(3, 4)).sum()  # opens step `index`: the spans below are in it
        for name, sleep_ms in (("a", 2), ("b", 3), ("a", 1 + index)):
            before_s, started = time.time(), time.perf_counter()
            with tracer.span(name):
                time.sleep(sleep_ms / 1000)
            entry = own.setdefault(f"{index} {name}", [before_s, 0.0, 0])
            entry[1] += (time.perf_counter() - started) * 1000
            entry[2] += 1
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with tracer.span("a"):  # after the last update: the last step's window, sent at the end
        time.sleep(0.002)
print(json.dumps({"compiled": step_state.fast_path is not None, "own": own}))
"""


@chooses_its_paths
@pytest.mark.parametrize("pure_python", [False, True])
def test_span_totals_match_the_scripts_own_clock(tmp_path, pure_python):
    env = dict(os.environ, TRACEML_RUN_DIR=str(tmp_path / "run"))
    if pure_python:
        env["TRACEML_NO_FASTPATH"] = "1"
    result = subprocess.run([sys.executable, "-c", SPAN_TIMES], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    outcome = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    python_asked = pure_python or step_state.python_timers_asked()
    assert outcome["compiled"] is (not python_asked and sys.platform in ("linux", "darwin"))
    with sqlite3.connect(tmp_path / "run" / "telemetry.sqlite") as db:
        stored = {f"{step} {name}": (start_s, ms, count) for step, name, start_s, ms, count in db.execute(
            "SELECT step, name, start_unix_s, duration_ms, count FROM spans")}
    own = outcome["own"]
    assert set(stored) == set(own)
    assert stored.pop("5 a")[2] == 3  # with the span after the last update, in its step's window
    for key, (start_s, ms, count) in own.items():
        if key == "5 a":
            continue
        assert stored[key][2] == count == (2 if key.endswith("a") else 1)
        # The span's own clock reads sit inside the script's: never more, and never less than
        # the sleeps inside (a busy machine may stretch the gap between the two clocks' reads).
        index, name = key.split()
        slept_ms = 2 + 1 + int(index) if name == "a" else 3
        assert slept_ms <= stored[key][1] <= ms, (key, stored[key], ms)
        # It starts after the script's clock read before it, by no more than the time the
        # script's clock holds and the span's does not (2 ms for the two clocks' reconciliation).
        assert start_s - 0.002 <= stored[key][0] <= start_s + (ms - stored[key][1]) / 1000 + 0.002, key


IDLE_CALLS = """
import gc, json, sys, torch, traceml
from torch import nn
from traceml.probe import step, step_state
class Net(nn.Module):  # the user's model, of its own class: the class whose call is timed
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
    def forward(self, inputs):
        return self.layer(inputs)
model, other = Net(), nn.Linear(4, 2)
optimizer, other_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, other))
for _ in range(2):
    with traceml.trace_step(model):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
ran = []
def note(frame, event, arg):
    if event == "call" and "/traceml/" in frame.f_code.co_filename:
        ran.append(frame.f_code.co_name)
gc.disable()  # TraceML's GC callback times collections, by design: not what is checked here
sys.setprofile(note)
for _ in range(3):  # between steps: a second model's training, data prep
    other(torch.ones(3, 4)).sum().backward()
    other_optimizer.step()
    other_optimizer.zero_grad()
    torch.ones(3).to(torch.float64)
sys.setprofile(None)
print(json.dumps({"compiled": step_state.fast_path is not None, "ran": ran}))
"""


@compiled
def test_code_outside_the_steps_runs_none_of_tracemls_python(tmp_path):
    # Outside the traced steps, with steps not inferred, the compiled timers pass backward, the
    # optimizer's hooks and Tensor.to straight on: each Python frame there cost idle code ~1 µs.
    result = subprocess.run([sys.executable, "-c", IDLE_CALLS], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=dict(os.environ, TRACEML_RUN_DIR=str(tmp_path / "run")))
    assert result.returncode == 0, result.stderr
    outcome = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert outcome == {"compiled": True, "ran": []}


FAULT_IN_ENTER = """
import torch
from torch import nn
from traceml.probe import layers


def broken_begin_step(self, step_index):
    raise RuntimeError("a fault inside the step's start")


layers.LayerProbe.begin_step = broken_begin_step  # deep-dive's work at the first step's start
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("trained", round(float(loss), 6))
"""


def test_a_fault_inside_enter_during_the_models_call_leaves_the_call_whole(tmp_path):
    """Zero-code: the model's first call opens the step (the compiled model timer calls the
    probe's __enter__, Python's phase_begin calls enter). A fault there takes TraceML out, which
    forgets the traced model while the timer is still using its entry: the timer must hold its
    own reference. Python's debug allocator overwrites freed memory, so a use after free ends
    the process."""
    script = tmp_path / "fault_enter.py"
    script.write_text(FAULT_IN_ENTER)
    result = subprocess.run([sys.executable, "-X", "dev", "-m", "traceml", "run", "--deep", "--mode", "summary",
                             str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                            env=dict(os.environ, PYTHONMALLOC="debug"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "disabled after an internal error in trace_step enter" in result.stderr
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    trained = [line for line in result.stdout.splitlines() if line.startswith("trained")]
    assert trained == [line for line in plain.stdout.splitlines() if line.startswith("trained")]


SPAN_TOTALS_CHURN = """
import gc, sys
import torch
import traceml
from traceml.probe import _fastpath, step

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
tracer = traceml.Trace()
totals_type = _fastpath.SpanTotal
before = sys.getrefcount(totals_type)
with tracer.trace("churn"):
    for i in range(3000):  # each step's first call of a name makes a SpanTotal, the next step's frees it
        with tracer.span("load"):
            batch = torch.ones(2, 4)
        with tracer.span("step%d" % (i % 7)):
            loss = model(batch).sum()
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if i % 500 == 0:
            step._probe.sender._buffer.clear()  # what the sender would take: freed here
    made = type(step._probe.span_totals["load"]) is totals_type
gc.collect()
assert sys.getrefcount(totals_type) == before, (sys.getrefcount(totals_type), before)
for name in ("ProbeState", "Timer", "TraceState", "SpanTotal"):
    delattr(_fastpath, name)  # the module's own references go: each type keeps the ones it owns
del totals_type
gc.collect()
print("made", made)
"""


@compiled
def test_span_totals_made_and_freed_many_times_leave_their_type_alone(tmp_path):
    result = subprocess.run([sys.executable, "-X", "dev", "-c", SPAN_TOTALS_CHURN], capture_output=True, text=True,
                            timeout=180, cwd=tmp_path,
                            env=dict(os.environ, PYTHONMALLOC="debug", TRACEML_RUN_DIR=str(tmp_path / "run")))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "made True" in result.stdout


FREE_THREADED = """
import sys
sys._is_gil_enabled = lambda: False  # what a free-threaded Python (3.13t) says with the GIL off
import torch, traceml
from traceml.probe import step, step_state
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    with traceml.trace_step(model):
        loss = model(torch.ones(2, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
assert "traceml.probe._fastpath" not in sys.modules  # never imported, so the GIL stays off
assert step_state.fast_path is None and step.StepProbe.__mro__[1] is step_state.PythonProbeState
print("steps", step._probe.step_index)
"""


@chooses_its_paths
def test_a_free_threaded_python_gets_the_python_timers(tmp_path):
    result = subprocess.run([sys.executable, "-c", FREE_THREADED], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=dict(os.environ, TRACEML_RUN_DIR=str(tmp_path / "run")))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "steps 4" in result.stdout
