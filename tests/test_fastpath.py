"""The compiled timers (probe/_fastpath.c) against the Python patches they stand in for: built
and used where a compiler is, the same figures on every shape of loop, and a fault in their
bookkeeping costs a figure, never the user's call."""
import json
import os
import sqlite3
import subprocess
import sys

import pytest
from conftest import SCRIPTS


def shapes_loop(tmp_path, script="shapes_loop.py", **env):
    tmp_path.mkdir()
    result = subprocess.run([sys.executable, str(SCRIPTS / script)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path,
                            env=dict(os.environ, TRACEML_RUN_DIR=str(tmp_path / "run"), **env))
    assert result.returncode == 0, result.stderr
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.skipif(sys.platform != "linux", reason="the compiled timers are built on Linux and macOS")
def test_the_compiled_timers_are_built_and_used():
    from traceml.probe import step

    assert step.fast_path is not None, "the C fast path did not build or load (see setup.py)"
    assert step.StepProbe.__mro__[1] is step.fast_path.ProbeState


def test_compiled_and_python_timers_agree_on_every_shape(tmp_path):
    compiled = shapes_loop(tmp_path / "c")
    python = shapes_loop(tmp_path / "p", TRACEML_PURE_PYTHON="1")
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


def test_compiled_and_python_agree_on_inferred_steps_spans_and_scalars(tmp_path):
    compiled = shapes_loop(tmp_path / "c", script="inferred_shapes_loop.py")
    python = shapes_loop(tmp_path / "p", script="inferred_shapes_loop.py", TRACEML_PURE_PYTHON="1")
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
from traceml.probe import step
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for broken in (False, True):
    with traceml.trace_step(model):
        if broken:  # the step's sums are no list of ints: every timer's addition fails
            step._probe.sums = None
            faults_before = step.fast_path.faults()
        loss = model(torch.ones(3, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(json.dumps({"faults": step.fast_path.faults() - faults_before, "grad": model.weight.grad is not None}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the compiled timers are built on Linux and macOS")
def test_a_fault_in_the_bookkeeping_costs_the_figure_not_the_call(tmp_path):
    result = subprocess.run([sys.executable, "-c", BROKEN_STEP], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=dict(os.environ, TRACEML_RUN_DIR=str(tmp_path / "run")))
    assert result.returncode == 0, result.stderr  # the user's steps ran whole
    outcome = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    # Forward's counts and its time, backward's and the optimizer's: each failed once, counted,
    # and said once at the end, on stderr, not in the user's output.
    assert outcome == {"faults": 4, "grad": True}
    assert "4 phase timings were lost to internal errors" in result.stderr


def test_a_full_buffer_drops_and_counts_each_new_record_and_each_sender_has_its_own():
    """The compiled push keeps the sender's buffer and capacity: it appends while there is
    room, then hands each record to push, which drops and counts it (never a wait)."""
    from test_records import hello

    from traceml.probe.sender import Sender
    from traceml.probe.step import EndedWindow, StepProbe

    for capacity in (3, 5):  # a second sender: its own buffer, its own capacity
        sender = Sender(hello(), capacity=capacity, address="127.0.0.1:1")  # never started: nothing drains
        probe = StepProbe(sender)
        for _ in range(10):
            with probe:
                pass
        # Each start after the first ends the step before: 9 windows ended, the last still open.
        assert [type(item) for item in sender._buffer] == [EndedWindow] * capacity
        assert sender.records_dropped == 9 - capacity
