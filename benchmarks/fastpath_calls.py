"""Per call, the compiled entry points that `--only calls` and idle_patches.py do not time: the
Trace API's span and log_scalar (a float), and drain_steps (the sender's thread: a step's
StepRecord made from the ring), each in a process with the C timers and one with
TRACEML_NO_FASTPATH=1; µs per call, the least of 9 rounds (the load adds, it never removes),
less an empty function's call in the same loop.

    python benchmarks/fastpath_calls.py [--calls 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import collections, json, sys, time, types
from traceml.probe.step_state import fast_path
from traceml.probe.step import StepProbe
from traceml.probe.step_records import StepRecords
from traceml.probe.tracer import Trace

calls = int(sys.argv[1])
buffer, spans = collections.deque(maxlen=1000), collections.deque(maxlen=1000)  # never full: no drop
sender = types.SimpleNamespace(_buffer=buffer, _spans=spans, capacity=10_000, push=buffer.append,
                               push_span=spans.append, ledger=None)
probe = StepProbe(sender)
records = StepRecords(probe)  # the sender's side, on this thread here
probe.due_step = float("inf")  # no work due at a start: each step takes the short path
tracer = Trace()
tracer._probe = probe
clock = time.perf_counter_ns


def span():
    with tracer.span("load"):
        pass


def scalar():
    tracer.log_scalar("loss", 1.5)


def empty():
    pass


def per_call(operation):
    start = clock()
    for _ in range(calls):
        operation()
    return (clock() - start) / calls / 1e3


figures = {"span": [], "log_scalar": [], "drain_steps, a step": [], "loop": []}
for _ in range(9):
    figures["loop"].append(per_call(empty))
    figures["span"].append(per_call(span))
    figures["log_scalar"].append(per_call(scalar))
    steps = min(calls, 500)
    for _ in range(steps):
        with probe:
            pass
    start = clock()
    made, dropped = records.drain_steps()
    assert len(made) >= steps - 1 and not dropped, (len(made), dropped)  # each start ends the step before
    figures["drain_steps, a step"].append((clock() - start) / len(made) / 1e3)
loop_us = min(figures.pop("loop"))  # the loop's own call, taken off the span's and the scalar's
print(json.dumps({"compiled": fast_path is not None, "span": min(figures["span"]) - loop_us,
                  "log_scalar": min(figures["log_scalar"]) - loop_us,
                  "drain_steps, a step": min(figures["drain_steps, a step"])}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    args = parser.parse_args()
    results = {}
    for way, switch in (("C", "0"), ("Python", "1")):
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.calls)], capture_output=True, text=True,
                             env=dict(os.environ, TRACEML_NO_FASTPATH=switch))
        if out.returncode:
            sys.exit(out.stderr)
        results[way] = json.loads(out.stdout.splitlines()[-1])
    assert results["C"]["compiled"] and not results["Python"]["compiled"], "the C timers are not built"
    print(f"µs per call, least of 9 rounds: {'call':<22} {'C':>6} {'Python':>7}")
    for name in ("span", "log_scalar", "drain_steps, a step"):
        print(f"  {name:<22} {results['C'][name]:6.2f} {results['Python'][name]:7.2f}")


if __name__ == "__main__":
    main()
