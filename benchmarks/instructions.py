"""Instructions TraceML adds per step, counted by valgrind's callgrind, on the training thread
and on TraceML's sender thread, for the explicit `trace_step` loop of overhead.py (or, with
--loop trace-api, its Trace API loop: steps inferred, a span and a scalar a step).

Counts, not times: they do not drift with this machine's load, so a change to the hot path or
to the sender shows here even when the timed benchmark's rounds scatter by more than it. They
are not the cost in time: on the training thread an added instruction costs several times its
share of an untraced step's (TraceML's code and data are cold there, the training having pushed
them out of the caches), and the sender's instructions run beside the training's, holding the GIL.

Each side runs twice, a 300-step loop and a longer one; the difference of the two, divided by
the steps between, leaves out start-up, the first steps and the end of the run. The sender's
rounds and the GIL's switch interval are slowed as much as valgrind slows the program (see
LOOP), so that the threads hand the GIL over as often per step as in a real run.

    python benchmarks/instructions.py [--steps 2000] [--loop explicit|trace-api]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import tempfile

WARM_UP_STEPS = 300

LOOP = r"""
import contextlib, gc, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

traced, steps, loop = sys.argv[1] == "traced", int(sys.argv[2]), sys.argv[3]
VALGRIND_SLOWDOWN = 50
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(steps * 8, 32), torch.randint(0, 10, (steps * 8,)))
batches = iter(DataLoader(data, batch_size=8))
import traceml
from traceml.probe import sender

# Under valgrind the program runs some 50 times slower while the sender's rounds and the GIL's
# switch interval keep the wall clock: slowed as much, the threads hand the GIL over as often
# per step as in a real run (else at every step, swelling both threads' counts).
sender.FLUSH_INTERVAL_S *= VALGRIND_SLOWDOWN
sys.setswitchinterval(sys.getswitchinterval() * VALGRIND_SLOWDOWN)
untraced = contextlib.nullcontext()
# torch's objects set aside from the collector: a full collection then walks only what the run
# made, so it costs about the same whichever thread it falls on (else a few million
# instructions land on the training thread in one run and on the sender's in the next).
gc.freeze()
if loop == "trace-api":
    tracer = traceml.Trace()
    span = tracer.span if traced else (lambda name: untraced)
    if traced:
        tracer.trace("instructions").__enter__()
    for _ in range(steps):
        inputs, targets = next(batches)
        with span("forward"):
            loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = loss.item()  # the script's own logging, on both sides
        if traced:
            tracer.log_scalar("loss", loss_value)
else:
    for _ in range(steps):
        inputs, targets = next(batches)
        with traceml.trace_step(model) if traced else untraced:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
"""


def _python_binary() -> str:
    """The interpreter itself: valgrind would count a wrapper script's shell (pyenv's shims)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _this_interpreters_path() -> str:
    """PYTHONPATH for the binary above: from a venv, that binary is the base interpreter, which
    knows none of the venv's packages (torch, traceml) unless it is handed this one's path."""
    return os.pathsep.join(entry for entry in sys.path if entry)


def count(workdir: str, side: str, steps: int, loop: str) -> dict:
    """Instructions of one run, per thread: {"training": n, "others": n}."""
    out = os.path.join(workdir, f"callgrind.{side}.{steps}")
    env = dict(os.environ, TRACEML_RUN_DIR=os.path.join(workdir, f"run-{side}-{steps}"),
               TRACEML_AUTO_CAPTURE="0",  # a capture's sampled steps would land in one run only
               PYTHONPATH=_this_interpreters_path())
    env.pop("TRACEML_COLLECTOR", None)
    subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
                    _python_binary(), os.path.join(workdir, "loop.py"), side, str(steps), loop],
                   env=env, cwd=workdir, check=True, capture_output=True)
    threads = {}
    for path in glob.glob(out + "-*"):
        with open(path) as profile:
            totals = [line for line in profile if line.startswith("summary:")]
        threads[int(path.rsplit("-", 1)[1])] = int(totals[0].split()[1])
    return {"training": threads.pop(1), "others": sum(threads.values())}  # thread 1: the main thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps between the short and the long run")
    parser.add_argument("--loop", choices=("explicit", "trace-api"), default="explicit")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind): nothing to count with")
    with tempfile.TemporaryDirectory() as workdir:
        with open(os.path.join(workdir, "loop.py"), "w") as out:
            out.write(LOOP)
        runs = [(side, steps) for side in ("untraced", "traced")
                for steps in (WARM_UP_STEPS, WARM_UP_STEPS + args.steps)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            counted = dict(zip(runs, pool.map(lambda run: count(workdir, *run, args.loop), runs)))
    loop = "explicit trace_step" if args.loop == "explicit" else "Trace API"
    print(f"instructions per step (callgrind, {loop} loop, {args.steps} steps between a "
          f"{WARM_UP_STEPS}-step and a {WARM_UP_STEPS + args.steps}-step run)")
    per_step = {(side, thread): (counted[(side, WARM_UP_STEPS + args.steps)][thread]
                                 - counted[(side, WARM_UP_STEPS)][thread]) / args.steps
                for side in ("untraced", "traced") for thread in ("training", "others")}
    for thread, label in (("training", "training thread"), ("others", "other threads (TraceML's sender)")):
        untraced, traced = per_step[("untraced", thread)], per_step[("traced", thread)]
        print(f"  {label:<33} untraced {untraced:12,.0f}   traced {traced:12,.0f}   added {traced - untraced:+10,.0f}")


if __name__ == "__main__":
    main()
