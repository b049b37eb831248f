"""What TraceML costs: µs added per step end to end and in each way of tracing, per DDP bucket,
and the fixed cost of `traceml run` over plain python.

End to end: what the user pays. The same script, a ~3,000-step loop (a tiny MLP fed by a torch
DataLoader with num_workers=0, the optimizer's step included), launched as `python loop.py` and
as `traceml run --mode summary loop.py` (the mode `traceml run` takes with no terminal: the
collector, the sender thread and the auto-captures run as in any real run), alternating plain, traced, plain,
traced, ... for a number of pairs, after one unmeasured launch of each. Two loop styles: the
explicit loop (`with traceml.trace_step(model):` under `traceml run`; under plain python the
script sees no TRACEML_COLLECTOR and enters a no-op context instead, TraceML never imported),
and zero-code (the loop with no trace_step, traced by `traceml run` alone). The script times its
own loop (perf_counter around it, after 300 warm-up steps), so the launch, the imports and the
end-of-run files (the fixed cost, below) are left out: a pair's figure is (traced loop s - plain
loop s) / steps, in µs. The figure printed is the median of the pairs, with their range; and,
beside it, the median of the pairs' whole-command wall time differences.

Per step, for each way a loop is traced (an explicit `trace_step` with a DataLoader, the same
loop in zero-code mode, the Trace API), one process runs blocks of 50 sub-millisecond steps (a
tiny MLP fed by a DataLoader) with TraceML attached and blocks with it detached (torch as it
was), in a shuffled order, so this machine's drifting noise hits both sides alike. The first
step after each switch is not counted (attaching rewrites torch's methods, and the interpreter
refills its caches). A round's figure is the median traced step minus the median untraced one:
everything TraceML adds, its patches' cost on every call included. The figure printed is the
median of the rounds, with their range. The collector stays up throughout, as in a real run.
Beside it, the CPU time per traced step of TraceML's sender thread (off the training thread,
but holding the GIL while it runs Python) and of the collector process the run started.

Per call: the explicit loop again, with a clock read between its calls (next(batches), the
trace_step() call, entering the block, the model, the loss, zero_grad, backward, the optimizer's
step, leaving the block): each call's median time traced minus untraced, per round. Where the
added µs go, patch by patch, to a few tenths of a µs where the whole step scatters by several.

Background included: the alternating blocks share the sender's and the collector's work between
both sides, so the figures above leave it out. Here two processes run the explicit loop, one
traced and one not, taking turns block by block in a shuffled order (nothing is patched between
blocks, and the background work lands on the traced side); then two untraced ones, the pair's
own bias. On a machine with no free core this is what TraceML costs the training.

Per DDP bucket: a one-rank gloo DDP model with one bucket per parameter, backward timed with
TraceML's comm hook and with DDP's own all-reduce, against the same with one bucket: what the
hook adds per bucket.

Wakes: what a thread beside the training costs it by how often it wakes (the sender wakes every
20 ms). An untraced loop runs beside a thread that wakes every P ms to do ~15 µs of Python (as
the sender's round might), in shuffled blocks against the same thread asleep: what a wake period
costs the median step.

Fixed cost: `traceml run --mode summary short.py` (collector, card, summary files and
report.html included) against `python short.py`, 100 tiny steps, alternating, wall clock from
outside, after one unmeasured launch of each (TraceML's bytecode cached, as after any install);
the figure is the median of each back-to-back pair's difference. The script's own clock splits
it: launch to torch imported, the steps, the last line to the command's end.

    python benchmarks/overhead.py [--rounds 5] [--blocks 20] [--launches 21] [--pairs 7] [--steps 3000]
                                  [--only e2e|steps|calls|background|ddp|wakes|fixed]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_STEP_US = 10.0
TARGET_BUCKET_US = 2.0
TARGET_FIXED_S = 0.1

LOOP = r"""
import contextlib, json, os, random, statistics, sys, threading, time
import psutil, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

mode, rounds, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
BLOCK = int(os.environ.get("OVERHEAD_BLOCK", "50"))
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
total = rounds * 2 * blocks * (BLOCK + 1) + 400
data = TensorDataset(torch.randn(total * 8, 32), torch.randint(0, 10, (total * 8,)))
batches = iter(DataLoader(data, batch_size=8))
untraced = contextlib.nullcontext()
no_span = lambda name: untraced

import traceml
from traceml.probe import process as probe_process
tracer = traceml.Trace()


def step_explicit(traced):
    inputs, targets = next(batches)
    with traceml.trace_step(model) if traced else untraced:
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def step_inferred(traced):  # zero-code mode: the loop as written without TraceML
    inputs, targets = next(batches)
    loss = nn.functional.cross_entropy(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def step_trace_api(traced):  # a span and a scalar a step, as the Trace API's example does
    span = tracer.span if traced else no_span
    inputs, targets = next(batches)
    with span("forward"):
        loss = nn.functional.cross_entropy(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    loss_value = loss.item()  # the script's own logging, on both sides
    if traced:
        tracer.log_scalar("loss", loss_value)


CALLS = ("next(batches)", "trace_step()", "__enter__", "model(inputs)", "cross_entropy", "zero_grad",
         "backward", "optimizer.step", "__exit__")
call_ns = {True: [], False: []}  # calls mode: each counted step's time per call, traced and untraced
clock = time.perf_counter_ns


def step_calls(traced, counted=True):  # the explicit loop, a clock read between its calls
    start = clock()
    inputs, targets = next(batches)
    loaded = clock()
    context = traceml.trace_step(model) if traced else untraced
    made = clock()
    with context:
        entered = clock()
        outputs = model(inputs)
        forward = clock()
        loss = nn.functional.cross_entropy(outputs, targets)
        lossed = clock()
        optimizer.zero_grad()
        zeroed = clock()
        loss.backward()
        backward = clock()
        optimizer.step()
        stepped = clock()
    exited = clock()
    if counted:
        call_ns[traced].append((loaded - start, made - loaded, entered - made, forward - entered, lossed - forward,
                                zeroed - lossed, backward - zeroed, stepped - backward, exited - stepped))


def attach():
    if mode in ("explicit", "calls", "turns-traced"):
        with traceml.trace_step(model):  # attaches again after a detach
            pass
    elif mode == "zero-code":
        probe_process.infer_steps(model=model)
    else:
        tracer.trace("overhead").__enter__()


one_step = {"explicit": step_explicit, "zero-code": step_inferred, "trace-api": step_trace_api,
            "calls": lambda traced: step_calls(traced, counted=False), "turns-traced": step_explicit,
            "turns-untraced": step_explicit}[mode]
traced_here = mode != "turns-untraced"  # a turn-taker untraced: TraceML never attached in it
if mode != "zero-code" and traced_here:  # zero-code: this process runs under python -m traceml.probe.zero_code
    attach()
for _ in range(300):  # warm-up, start-up and the collector
    one_step(traced_here)


def take_turns():  # background part: run a block of steps each time the parent says so
    go = os.fdopen(int(os.environ["OVERHEAD_GO_FD"]), "rb", 0)
    done = os.fdopen(int(os.environ["OVERHEAD_DONE_FD"]), "wb", 0)
    done.write(b"r")
    block_us = []
    while go.read(1) == b"g":
        one_step(traced_here)  # not counted, as after a switch
        step_ns, last = [], time.perf_counter_ns()
        for _ in range(BLOCK):
            one_step(traced_here)
            now = time.perf_counter_ns()
            step_ns.append(now - last)
            last = now
        block_us.append(statistics.median(step_ns) / 1e3)
        done.write(b"d")
    print(json.dumps({"block_us": block_us}), flush=True)
    sys.exit(0)


if mode.startswith("turns"):
    time.sleep(0.2)  # the warm-up's records sent
    take_turns()


def background_cpu_s():  # CPU time so far of TraceML's sender thread and of the collector it started
    sender_s = sum(time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) for thread in threading.enumerate()
                   if thread.name == "traceml-sender")
    collector_s = sum(sum(child.cpu_times()[:2]) for child in psutil.Process().children(recursive=True))
    return sender_s, collector_s


time.sleep(0.2)  # the warm-up's records sent
background_before_s = background_cpu_s()
figures, call_figures = [], []
for round_index in range(rounds):
    order = [True] * blocks + [False] * blocks
    random.Random(round_index).shuffle(order)
    step_ns = {True: [], False: []}
    for traced in order:
        attach() if traced else probe_process.detach()
        one_step(traced)  # refills the caches the switch emptied: not counted
        last = time.perf_counter_ns()
        for _ in range(BLOCK):
            step_calls(traced) if mode == "calls" else one_step(traced)
            now = time.perf_counter_ns()
            step_ns[traced].append(now - last)
            last = now
    figures.append((statistics.median(step_ns[True]) / 1e3, statistics.median(step_ns[False]) / 1e3))
    if mode == "calls":  # per call: the median traced minus the median untraced, this round
        call_figures.append([(statistics.median(row[index] for row in call_ns[True])
                              - statistics.median(row[index] for row in call_ns[False])) / 1e3
                             for index in range(len(CALLS))])
        call_ns[True].clear()
        call_ns[False].clear()
attach()
time.sleep(0.2)  # the last records sent
traced_steps = rounds * blocks * (BLOCK + 1)
sender_s, collector_s = (after - before for after, before in zip(background_cpu_s(), background_before_s))
print(json.dumps({"rounds": figures, "calls": dict(zip(CALLS, zip(*call_figures))),
                  "sender_us": sender_s * 1e6 / traced_steps, "collector_us": collector_s * 1e6 / traced_steps}))
"""

E2E = r"""
import contextlib, json, os, sys, threading, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

style, steps, warm_up = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
traced = bool(os.environ.get("TRACEML_COLLECTOR"))  # set by `traceml run` for the script it runs
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn((warm_up + steps) * 8, 32), torch.randint(0, 10, ((warm_up + steps) * 8,)))
loader = DataLoader(data, batch_size=8)  # num_workers=0: batches made on the training thread
untraced = contextlib.nullcontext()
if style == "explicit" and traced:
    import traceml


def explicit():  # with trace_step under traceml run; a no-op context under plain python
    start_s = None
    for step, (inputs, targets) in enumerate(loader):
        if step == warm_up:
            start_s = time.perf_counter()
        with traceml.trace_step(model) if traced else untraced:
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return time.perf_counter() - start_s


def zero_code():  # the loop as written without TraceML: traced by traceml run alone
    start_s = None
    for step, (inputs, targets) in enumerate(loader):
        if step == warm_up:
            start_s = time.perf_counter()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start_s


loop_s = {"explicit": explicit, "zero-code": zero_code}[style]()
probe = sender = False
if traced:  # TraceML is at work: its probe made, its sender thread running
    from traceml.probe import step as probe_step

    probe = probe_step._probe is not None
    sender = any(thread.name == "traceml-sender" for thread in threading.enumerate())
print(json.dumps({"loop_s": loop_s, "traced": traced, "probe": probe, "sender": sender}))
"""

DDP = r"""
import json, os, random, statistics, sys, tempfile, time
import torch
import torch.distributed as dist
from torch import nn

steps = int(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
import traceml

LAYERS = 16


def make(bucket_cap_mb):
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)])
    # A bucket's size counts its parameters' bytes: a tiny cap gives each parameter its own.
    return nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)


models = {("traced", "many"): make(1e-6), ("traced", "one"): make(100.0),
          ("untraced", "many"): make(1e-6), ("untraced", "one"): make(100.0)}
inputs = torch.randn(4, 16)


def backward_us(key):
    model = models[key]
    loss = model(inputs).sum()
    start = time.perf_counter_ns()
    loss.backward()
    return (time.perf_counter_ns() - start) / 1e3


def one(key):
    if key[0] == "traced":
        with traceml.trace_step(models[key]):
            return backward_us(key)
    return backward_us(key)


for key in models:
    for _ in range(50):
        one(key)
order = [key for key in models for _ in range(steps)]
random.Random(0).shuffle(order)
times = {key: [] for key in models}
for key in order:
    times[key].append(one(key))
median = {key: statistics.median(value) for key, value in times.items()}
# DDP's own count of the buckets it reduced in the last backward (after its first, it rebuilds them).
buckets = {size: models[("untraced", size)]._get_ddp_logging_data()["num_buckets_reduced"] for size in ("many", "one")}
added_many = median[("traced", "many")] - median[("untraced", "many")]
added_one = median[("traced", "one")] - median[("untraced", "one")]
print(json.dumps({"buckets": buckets["many"], "added_many_us": added_many, "added_one_us": added_one,
                  "per_bucket_us": (added_many - added_one) / (buckets["many"] - buckets["one"])}))
"""

WAKES = r"""
import json, random, statistics, sys, threading, time
import torch
from torch import nn

rounds = int(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
inputs, targets = torch.randn(8, 32), torch.randint(0, 10, (8,))
PERIODS_S = {"asleep": None, "100 ms": 0.1, "20 ms": 0.02, "5 ms": 0.005}
period_s = [None]
period_changed = threading.Event()


def waker():
    while True:
        if period_s[0] is None:  # asleep: not woken until the period changes
            period_changed.wait()
            period_changed.clear()
            continue
        time.sleep(period_s[0])
        total = 0
        for i in range(300):  # ~15 µs of Python, holding the GIL
            total += i


def step():
    loss = nn.functional.cross_entropy(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


threading.Thread(target=waker, daemon=True).start()
for _ in range(300):
    step()
added = {name: [] for name in PERIODS_S if name != "asleep"}
for round_index in range(rounds):
    order = [name for name in PERIODS_S for _ in range(20)]
    random.Random(round_index).shuffle(order)
    step_ns = {name: [] for name in PERIODS_S}
    for name in order:
        period_s[0] = PERIODS_S[name]
        period_changed.set()
        time.sleep(0.03)
        last = time.perf_counter_ns()
        for _ in range(50):
            step()
            now = time.perf_counter_ns()
            step_ns[name].append(now - last)
            last = now
    asleep = statistics.median(step_ns["asleep"])
    for name in added:
        added[name].append((statistics.median(step_ns[name]) - asleep) / 1e3)
print(json.dumps({"step_us": asleep / 1e3, "added_us": added}))
"""

SHORT = r"""
import sys, time
import torch
from torch import nn
imported = time.time()  # zero-code mode imports torch before the script's first line
torch.set_num_threads(1)
model = nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
inputs, targets = torch.randn(8, 16), torch.randn(8, 4)
for _ in range(100):
    loss = nn.functional.mse_loss(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"segments {imported} {time.time()}", file=sys.stderr)
"""
# Where the fixed cost goes, from the script's own clock: launch to torch imported, the steps,
# the script's last line to the command's end (the script's teardown, then the launcher's end).
SEGMENTS = ("launch -> torch imported", "the 100 steps", "last line -> command ends")


def _write_script(workdir: str, name: str, text: str) -> str:
    """A part's child script, written into the work directory; its path."""
    path = os.path.join(workdir, name)
    with open(path, "w") as out:
        out.write(text)
    return path


def _child_env(workdir: str, name: str) -> dict:
    env = dict(os.environ, TRACEML_RUN_DIR=os.path.join(workdir, name))
    env.pop("TRACEML_COLLECTOR", None)
    return env


def _run_json(command: list, env: dict, cwd: str) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        sys.exit(f"benchmark child failed ({' '.join(command[-4:])}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def _launch_env() -> dict:
    """The environment of a launch timed from outside: as a user's shell would give it."""
    env = dict(os.environ)
    # As after any install, TraceML's modules load from cached bytecode: with
    # PYTHONDONTWRITEBYTECODE set (as in some sandboxes and containers), every launch would
    # compile them from source again, some 15 ms in the launcher and as much in the script.
    for name in ("TRACEML_COLLECTOR", "TRACEML_RUN_DIR", "PYTHONDONTWRITEBYTECODE"):
        env.pop(name, None)
    return env


E2E_WARM_UP = 300
E2E_STYLES = ("explicit", "zero-code")


def end_to_end(pairs: int, steps: int, workdir: str) -> None:
    """The whole loop's time under `traceml run` against plain python, launch by launch."""
    script = _write_script(workdir, "e2e.py", E2E)
    env = _launch_env()

    def commands(style: str, launch: object, count: int, warm_up: int) -> dict:
        args = [script, style, str(count), str(warm_up)]
        return {"python": [sys.executable, *args],
                "traceml run": [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir",
                                os.path.join(workdir, f"e2e-{style}-{launch}"), *args]}

    def launch(command: list, traced: bool) -> tuple:
        start_s = time.perf_counter()
        result = _run_json(command, env, workdir)
        wall_s = time.perf_counter() - start_s
        if result["traced"] != traced or (traced and not (result["probe"] and result["sender"])):
            sys.exit(f"benchmark child not {'traced' if traced else 'untraced'} as meant: {result}")
        return result["loop_s"], wall_s

    for style in E2E_STYLES:  # writes the bytecode, fills the page cache: not counted
        for name, command in commands(style, "warm-up", 20, 10).items():
            launch(command, name == "traceml run")
    loops: dict = {style: {"python": [], "traceml run": []} for style in E2E_STYLES}
    walls: dict = {style: {"python": [], "traceml run": []} for style in E2E_STYLES}
    started_s = time.perf_counter()
    for pair in range(pairs):
        for style in E2E_STYLES:
            for name, command in commands(style, pair, steps, E2E_WARM_UP).items():  # plain, then traced
                loop_s, wall_s = launch(command, name == "traceml run")
                loops[style][name].append(loop_s)
                walls[style][name].append(wall_s)
    taken_s = time.perf_counter() - started_s
    added = {style: [1e6 * (traced - plain) / steps
                     for plain, traced in zip(loops[style]["python"], loops[style]["traceml run"])]
             for style in E2E_STYLES}
    print(f"end to end: `traceml run --mode summary` against `python`, the whole loop's time ({steps} steps after "
          f"{E2E_WARM_UP} warm-up, the script's own clock), {pairs} pairs alternating plain, traced "
          f"({taken_s:.0f} s); added: (traced loop s - plain loop s) / steps")
    print(f"  {'pair':>4}  " + "   ".join(f"{style + ': python s':>19} {'traced s':>8} {'added µs':>8}"
                                           for style in E2E_STYLES))
    for pair in range(pairs):
        print(f"  {pair + 1:>4}  " + "   ".join(
            f"{loops[style]['python'][pair]:19.3f} {loops[style]['traceml run'][pair]:8.3f} "
            f"{added[style][pair]:+8.1f}" for style in E2E_STYLES))
    print(f"  {'loop style':<12} {'python µs':>9} {'traced µs':>10} {'added µs':>9}  {'range':>16} {'ratio':>6}  "
          f"{'target':<19} whole command added s")
    for style in E2E_STYLES:
        plain_us = 1e6 * statistics.median(loops[style]["python"]) / steps
        traced_us = 1e6 * statistics.median(loops[style]["traceml run"]) / steps
        added_us = statistics.median(added[style])
        command_added_s = statistics.median(t - p for p, t in zip(walls[style]["python"], walls[style]["traceml run"]))
        verdict = "ok" if added_us <= TARGET_STEP_US else "OVER"
        print(f"  {style:<12} {plain_us:9.1f} {traced_us:10.1f} {added_us:+9.1f}  "
              f"[{min(added[style]):+6.1f}, {max(added[style]):+6.1f}] {(plain_us + added_us) / plain_us:6.3f}  "
              f"<= {TARGET_STEP_US:g} µs {verdict:<5}  {command_added_s:+.3f}")
    print("  everything a traced step costs the training, the sender's and the collector's work included "
          "(on this 2-core machine they share the cores with it); the whole command's difference adds the "
          "launch, the warm-up steps and the end-of-run files (see the fixed cost)")


def per_step(rounds: int, blocks: int, workdir: str) -> None:
    script = _write_script(workdir, "loop.py", LOOP)
    print(f"per step: {rounds} rounds, each {blocks} blocks of 50 steps traced and {blocks} untraced, "
          "shuffled; median of the rounds [their range]")
    print(f"  {'traced as':<12} {'untraced µs':>11} {'traced µs':>10} {'added µs':>9}  "
          f"{'range':>13} {'ratio':>6}  {'target':<18} CPU µs/step: sender  collector")
    for mode in ("explicit", "zero-code", "trace-api"):
        command = [sys.executable, script, mode, str(rounds), str(blocks)]
        if mode == "zero-code":
            command[1:2] = ["-m", "traceml.probe.zero_code", script]
        result = _run_json(command, _child_env(workdir, f"run-{mode}"), workdir)
        figures = result["rounds"]
        added = [traced - untraced for traced, untraced in figures]
        added_us = statistics.median(added)
        untraced_us = statistics.median(untraced for _, untraced in figures)
        traced_us = statistics.median(traced for traced, _ in figures)
        verdict = "ok" if added_us <= TARGET_STEP_US else "OVER"
        print(f"  {mode:<12} {untraced_us:11.1f} {traced_us:10.1f} {added_us:+9.1f}  "
              f"[{min(added):+5.1f}, {max(added):+5.1f}] {(untraced_us + added_us) / untraced_us:6.3f}  "
              f"<= {TARGET_STEP_US:g} µs {verdict:<5}  {result['sender_us']:11.1f}  {result['collector_us']:9.1f}")
    print("  CPU per traced step, beside the training: TraceML's sender thread (records, capture rules, sending; "
          "it holds the GIL while it runs Python) and the collector process (storing, rolling up). Both run on "
          "other cores when there are any; with none free (this 2-core machine) they take the training's "
          "time too, which the alternating blocks share between both sides")


def per_call(rounds: int, blocks: int, workdir: str) -> None:
    """Where the explicit loop's added µs go: the same blocks, a clock read between the calls."""
    script = _write_script(workdir, "loop.py", LOOP)
    result = _run_json([sys.executable, script, "calls", str(rounds), str(blocks)], _child_env(workdir, "run-calls"),
                       workdir)
    print(f"per call, explicit trace_step: traced minus untraced, median of each call's time in a block's steps, "
          f"median of {rounds} rounds [their range]")
    for name, added in result["calls"].items():
        print(f"  {name:<16} {statistics.median(added):+6.2f} µs  [{min(added):+.2f}, {max(added):+.2f}]")
    total = [traced - untraced for traced, untraced in result["rounds"]]
    print(f"  {'the whole step':<16} {statistics.median(total):+6.2f} µs  [{min(total):+.2f}, {max(total):+.2f}]"
          "  (not the calls' sum: each figure is a median)")


def _turn_taker(script: str, mode: str, blocks: int, workdir: str) -> tuple:
    """A child running the explicit loop a block at a time: (process, its go pipe, its done pipe)."""
    go_read, go_write = os.pipe()
    done_read, done_write = os.pipe()
    env = dict(_child_env(workdir, f"run-{mode}-{go_read}"), OVERHEAD_GO_FD=str(go_read),
               OVERHEAD_DONE_FD=str(done_write))
    with open(os.path.join(workdir, f"{mode}-{go_read}.stderr"), "w") as stderr:  # the card and any error
        child = subprocess.Popen([sys.executable, script, mode, "1", str(blocks)], env=env, cwd=workdir,
                                 pass_fds=(go_read, done_write), stdout=subprocess.PIPE, stderr=stderr, text=True)
    os.close(go_read)
    os.close(done_write)
    return child, os.fdopen(go_write, "wb", 0), os.fdopen(done_read, "rb", 0)


def background(rounds: int, blocks: int, workdir: str) -> None:
    """TraceML's whole cost with its work beside the training: two processes run the same loop,
    one traced and one not, taking turns block by block (nothing patched between blocks), so
    the sender's and the collector's work lands on the traced side only; and the same with
    both untraced, the pair's own bias."""
    script = _write_script(workdir, "loop.py", LOOP)
    print(f"background included: two processes taking turns, {rounds} rounds of {blocks} blocks of 50 steps "
          "each, shuffled; median of the rounds [their range]")
    for label, modes in (("traced vs untraced", ("turns-traced", "turns-untraced")),
                         ("untraced vs untraced", ("turns-untraced", "turns-untraced"))):
        children = [_turn_taker(script, mode, rounds * blocks + 1, workdir) for mode in modes]
        for _, _, done in children:
            if done.read(1) != b"r":
                sys.exit(f"benchmark child failed before its first block ({label})")
        for round_index in range(rounds):
            order = [0] * blocks + [1] * blocks
            random.Random(round_index).shuffle(order)
            for side in order:
                _, go, done = children[side]
                go.write(b"g")
                if done.read(1) != b"d":
                    sys.exit(f"benchmark child failed in a block ({label})")
        block_us = []
        for child, go, done in children:
            go.close()
            lines = [line for line in child.stdout.read().splitlines() if line.startswith("{")]
            child.wait()
            done.close()
            block_us.append(json.loads(lines[0])["block_us"])
        added = [statistics.median(block_us[0][r * blocks:(r + 1) * blocks])
                 - statistics.median(block_us[1][r * blocks:(r + 1) * blocks]) for r in range(rounds)]
        print(f"  {label:<22} added {statistics.median(added):+6.1f} µs  [{min(added):+.1f}, {max(added):+.1f}]"
              f"  (untraced step {statistics.median(block_us[1]):.0f} µs)")


def per_bucket(workdir: str) -> None:
    script = _write_script(workdir, "ddp.py", DDP)
    result = _run_json([sys.executable, script, "1500"], _child_env(workdir, "run-ddp"), workdir)
    verdict = "ok" if result["per_bucket_us"] <= TARGET_BUCKET_US else "OVER"
    print("DDP, per gradient bucket (gloo, 1 rank): backward traced vs untraced, 32 buckets against 1")
    print(f"  {result['buckets']} buckets: {result['added_many_us']:+.1f} µs a step; 1 bucket: "
          f"{result['added_one_us']:+.1f} µs; per bucket: {result['per_bucket_us']:+.2f} µs   "
          f"target: <= {TARGET_BUCKET_US:g} µs {verdict}")


def wakes(rounds: int, workdir: str) -> None:
    script = _write_script(workdir, "wakes.py", WAKES)
    result = _run_json([sys.executable, script, str(rounds)], dict(os.environ), workdir)
    print(f"a thread beside the training waking every P ms (~15 µs of Python each time), against it "
          f"asleep: added to the median step of {result['step_us']:.0f} µs, median of {rounds} rounds [range]")
    for name, added in result["added_us"].items():
        print(f"  every {name:<7} {statistics.median(added):+6.1f} µs  [{min(added):+.1f}, {max(added):+.1f}]")


def fixed_cost(launches: int, workdir: str) -> None:
    script = _write_script(workdir, "short.py", SHORT)
    env = _launch_env()

    def commands(launch: object) -> dict:
        return {"python": [sys.executable, script],
                "traceml run": [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir",
                                os.path.join(workdir, f"fixed-{launch}"), script]}

    for command in commands("warm-up").values():  # writes the bytecode, fills the page cache
        subprocess.run(command, capture_output=True, env=env, cwd=workdir, check=True)
    walls: dict = {"python": [], "traceml run": []}
    segments: dict = {"python": [], "traceml run": []}
    for launch in range(launches):
        named = commands(launch)
        order = list(named) if launch % 2 == 0 else list(reversed(named))
        for name in order:
            start_s, start_unix_s = time.perf_counter(), time.time()
            done = subprocess.run(named[name], capture_output=True, text=True, env=env, cwd=workdir, check=True)
            walls[name].append(time.perf_counter() - start_s)
            ended_unix_s = time.time()
            imported_s, last_line_s = map(float, done.stderr.split("segments ")[1].split()[:2])
            segments[name].append((imported_s - start_unix_s, last_line_s - imported_s, ended_unix_s - last_line_s))
    plain, traced = statistics.median(walls["python"]), statistics.median(walls["traceml run"])
    # Each launch's pair ran back to back: the median of the pairs' differences leaves out
    # this machine's drift from one minute to the next, which a difference of medians keeps.
    added = sorted(t - p for t, p in zip(walls["traceml run"], walls["python"]))
    added_s = statistics.median(added)
    quartiles = statistics.quantiles(added, n=4) if len(added) > 1 else [added_s] * 3
    verdict = "ok" if added_s <= TARGET_FIXED_S else "OVER"
    print(f"fixed cost: a 100-step script, {launches} launches each, alternating, after one warm-up "
          "each; added: the median of the pairs' differences [quartiles] (range)")
    print(f"  python: {plain:.3f} s   traceml run --mode summary: {traced:.3f} s   added: {added_s:+.3f} s "
          f"[{quartiles[0]:+.3f}, {quartiles[2]:+.3f}] ({added[0]:+.3f}, {added[-1]:+.3f})   "
          f"target: <= {TARGET_FIXED_S:g} s {verdict}")
    for index, name in enumerate(SEGMENTS):
        pairs = [t[index] - p[index] for t, p in zip(segments["traceml run"], segments["python"])]
        print(f"  {name}: python {1e3 * statistics.median(p[index] for p in segments['python']):.0f} ms, "
              f"added {1e3 * statistics.median(pairs):+.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per way of tracing")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of 50 steps on each side, per round")
    parser.add_argument("--launches", type=int, default=21, help="launches on each side, fixed cost")
    parser.add_argument("--pairs", type=int, default=7, help="pairs of launches per loop style, end to end")
    parser.add_argument("--steps", type=int, default=3000, help="steps a launch times, end to end")
    parser.add_argument("--only", choices=("e2e", "steps", "calls", "background", "ddp", "wakes", "fixed"),
                        help="run one part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        if args.only in (None, "e2e"):
            end_to_end(args.pairs, args.steps, workdir)
        if args.only in (None, "steps"):
            per_step(args.rounds, args.blocks, workdir)
        if args.only in (None, "calls"):
            per_call(args.rounds, args.blocks, workdir)
        if args.only in (None, "background"):
            background(args.rounds, args.blocks, workdir)
        if args.only in (None, "ddp"):
            per_bucket(workdir)
        if args.only in (None, "wakes"):
            wakes(args.rounds, workdir)
        if args.only in (None, "fixed"):
            fixed_cost(args.launches, workdir)


if __name__ == "__main__":
    main()
