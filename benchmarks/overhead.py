"""What TraceML costs: µs added per step, and the fixed cost of `traceml run` over plain python.

Per step: one process runs ~3000 traced and ~3000 untraced sub-millisecond steps (a tiny MLP
fed by a DataLoader), interleaved in a shuffled order so this machine's drifting noise hits both
sides alike; the untraced steps use an identical model that was never hooked. The patches TraceML
installs also cost a little on untraced steps: that part is measured on blocks of untraced
steps with TraceML attached (idle) or detached (torch as it was), in a shuffled order. The sum is what
tracing adds to a step. The collector TraceML starts stays up throughout, as in a real run.

Fixed cost: `traceml run short.py` (traced, card and run directory included) against
`python short.py` (untraced), alternating, wall-clock from outside.

    python benchmarks/overhead.py [--steps 3000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import contextlib, copy, json, random, statistics, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

mode, steps = sys.argv[1], int(sys.argv[2])
warmup = 200
torch.manual_seed(0)
torch.set_num_threads(1)
class MLP(nn.Sequential):
    pass

class TwinMLP(nn.Sequential):  # another class: TraceML's timing on MLP's class never runs for it
    pass

traced_model = MLP(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
plain_model = TwinMLP(*copy.deepcopy(list(traced_model)))  # never given to trace_step
optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=0.01) for m in (traced_model, plain_model)}
total = 4 * steps + warmup + 2 * (steps // 50) + 10
data = TensorDataset(torch.randn(total * 8, 32), torch.randint(0, 10, (total * 8,)))
batches = iter(DataLoader(data, batch_size=8))
untraced = lambda model: contextlib.nullcontext()

def one_step(step_context, model):
    inputs, targets = next(batches)
    with step_context(model):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer = optimizers[id(model)]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

def run_block(step_context, model, count):
    times_ns = []
    last = time.perf_counter_ns()
    for _ in range(count):
        one_step(step_context, model)
        now = time.perf_counter_ns()
        times_ns.append(now - last)
        last = now
    return statistics.median(times_ns) / 1e3

if mode == "untraced":  # a short script for the fixed-cost measurement
    run_block(untraced, plain_model, steps)
    sys.exit(0)
import traceml
from traceml.probe import step as probe_step
if mode == "traced":
    run_block(traceml.trace_step, traced_model, steps)
    sys.exit(0)
run_block(traceml.trace_step, traced_model, warmup)  # start-up and the collector

# 1. Traced and untraced steps interleaved in a shuffled order, patches installed: what tracing
#    a step costs beyond the patches' idle cost. Shuffled, not strictly alternating, so that
#    anything periodic (a gen-0 collection every other step) cannot land on one side only.
order = [True] * steps + [False] * steps
random.Random(0).shuffle(order)
times_ns = {True: [], False: []}
last = time.perf_counter_ns()
for traced in order:
    one_step(traceml.trace_step if traced else untraced, traced_model if traced else plain_model)
    now = time.perf_counter_ns()
    times_ns[traced].append(now - last)
    last = now
traced_us = statistics.median(times_ns[True]) / 1e3
untraced_us = statistics.median(times_ns[False]) / 1e3

# 2. The patches' idle cost: untraced steps with TraceML attached (patches in, no model
#    hooked) or detached (torch as it was), in blocks of 50 in a shuffled order. Blocks, not
#    single steps: attaching or detaching rewrites torch.Tensor's methods, which empties the
#    interpreter's type caches, and the step right after pays for refilling them.
block = 50
order = [True] * (steps // block) + [False] * (steps // block)
random.Random(1).shuffle(order)
idle_ns = {True: [], False: []}
for attached in order:
    if attached:
        with traceml.trace_step(None):  # attaches again when detached
            pass
    else:
        probe_step.detach()
    one_step(untraced, plain_model)  # the step that refills the caches is not counted
    for _ in range(block):
        start = time.perf_counter_ns()
        one_step(untraced, plain_model)
        idle_ns[attached].append(time.perf_counter_ns() - start)
idle_us = (statistics.median(idle_ns[True]) - statistics.median(idle_ns[False])) / 1e3
print(json.dumps({"traced_us": traced_us, "untraced_us": untraced_us, "idle_us": idle_us}))
"""


def per_step(steps: int, workdir: str) -> None:
    script = os.path.join(workdir, "bench_child.py")
    with open(script, "w") as out:
        out.write(CHILD)
    env = dict(os.environ, TRACEML_RUN_DIR=os.path.join(workdir, "per-step-run"))
    env.pop("TRACEML_COLLECTOR", None)
    out = subprocess.run([sys.executable, script, "alternate", str(steps)],
                         capture_output=True, text=True, env=env, cwd=workdir, check=True).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    traced_us, untraced_us = result["traced_us"], result["untraced_us"]
    idle_us = result["idle_us"]
    added_us = traced_us - untraced_us + idle_us
    print(f"per step: {steps} traced and {steps} untraced steps, interleaved in a shuffled order")
    print(f"  untraced step median:              {untraced_us:8.1f} µs")
    print(f"  traced step median:                {traced_us:8.1f} µs")
    print(f"  installed patches, on any step:    {idle_us:+8.1f} µs "
          "(blocks attached vs detached, shuffled)")
    print(f"  added per step:                    {added_us:+8.1f} µs   target: <= 20 µs")
    print(f"  ratio traced/untraced:             {(untraced_us + added_us) / untraced_us:8.3f}")

def fixed_cost(rounds: int, workdir: str) -> None:
    script = os.path.join(workdir, "bench_child.py")
    env = dict(os.environ)
    env.pop("TRACEML_COLLECTOR", None)
    env.pop("TRACEML_RUN_DIR", None)
    walls = {"python": [], "traceml run": []}
    for round_index in range(rounds):
        commands = {
            "python": [sys.executable, script, "untraced", "20"],
            "traceml run": [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir",
                            os.path.join(workdir, f"fixed-{round_index}"), script, "traced", "20"],
        }
        order = list(commands) if round_index % 2 == 0 else list(reversed(commands))
        for name in order:
            start = time.perf_counter()
            subprocess.run(commands[name], capture_output=True, env=env, cwd=workdir, check=True)
            walls[name].append(time.perf_counter() - start)
    plain, traced = statistics.median(walls["python"]), statistics.median(walls["traceml run"])
    print(f"fixed cost (a 20-step script, {rounds} rounds, alternating)")
    print(f"  python: {plain:.3f} s   traceml run: {traced:.3f} s   "
          f"added: {traced - plain:+.3f} s   target: <= 1 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps on each side")
    parser.add_argument("--rounds", type=int, default=5, help="launches on each side, fixed cost")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        per_step(args.steps, workdir)
        fixed_cost(args.rounds, workdir)


if __name__ == "__main__":
    main()
