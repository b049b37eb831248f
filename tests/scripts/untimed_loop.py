"""A tiny loop whose time goes to code TraceML does not time: a helper after optimizer.step()
inside the step (--helper-ms), work between steps (--between-ms), and a start that walks a
registry of modules and builds something at module level (--modules, --build-ms). It writes its
own timing of each to --timings: each step's start, and the time in the helper and between steps.
With --until PATH it goes on past --steps until PATH holds an UNTRACED_WORK alert (written by the
test's --on-alert command), for at most --until-s more seconds: a loaded machine's run lasts as long as
the alert takes."""
import argparse
import importlib
import json
import os
import sys
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--helper-ms", type=float, default=0.0)
parser.add_argument("--between-ms", type=float, default=0.0)
parser.add_argument("--modules", type=int, default=0)
parser.add_argument("--build-ms", type=float, default=0.0)
parser.add_argument("--timings", required=True)
parser.add_argument("--until", default=None)
parser.add_argument("--until-s", type=float, default=60.0)
args = parser.parse_args()
timings = {"lines": {}}
started = time.perf_counter()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import traceml  # noqa: E402


def make_registry(count):
    """A folder of `count` tiny modules, as a lazy model registry points at."""
    folder = tempfile.mkdtemp()
    os.makedirs(os.path.join(folder, "registry_pkg"))
    open(os.path.join(folder, "registry_pkg", "__init__.py"), "w").close()
    for index in range(count):
        with open(os.path.join(folder, "registry_pkg", f"model_{index}.py"), "w") as module:
            module.write(f"import json\nCONFIG = json.loads('{{\"index\": {index}}}')\n" + "X = 1\n" * 200)
    sys.path.insert(0, folder)
    return count


def build(ms):
    """Building the model and the data: one-off work before the loop (CPU work, in torch)."""
    weights, end = torch.eye(64) * 0.5, time.perf_counter() + ms / 1e3
    while time.perf_counter() < end: weights = torch.tanh(weights @ weights)  # noqa: E701
    return weights


walk_started = time.perf_counter()
REGISTRY = [importlib.import_module(f"registry_pkg.model_{i}") for i in range(make_registry(args.modules))]  # WALK
timings["walk_s"] = time.perf_counter() - walk_started
timings["lines"]["walk"] = sys._getframe().f_lineno - 2
build_started = time.perf_counter()
built = build(args.build_ms)
timings["build_s"] = time.perf_counter() - build_started
timings["lines"]["build"] = build.__code__.co_firstlineno + 3


def update_metrics(weights, ms):
    """Metrics after the update, inside the step: what TraceML cannot time."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end: weights = torch.tanh(weights @ weights)  # noqa: E701
    return weights


def log_everything(weights, ms):
    """Work between steps."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end: weights = torch.tanh(weights @ weights)  # noqa: E701
    return weights


timings["lines"]["update_metrics"] = update_metrics.__code__.co_firstlineno + 3
timings["lines"]["log_everything"] = log_everything.__code__.co_firstlineno + 3
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
inputs, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))
weights = torch.eye(64) * 0.5
helper_s, between_s, starts = [], [], []  # each step's, by the script's own clock


def more_steps(step):
    if step < args.steps:
        return True
    return args.until is not None and not alerted(args.until) and time.perf_counter() < until_deadline


def alerted(path):
    try:
        with open(path) as alerts:
            return '"UNTRACED_WORK"' in alerts.read()
    except OSError:
        return False


until_deadline = time.perf_counter() + args.until_s
step = 0
while more_steps(step):
    step += 1
    starts.append(time.perf_counter())
    with traceml.trace_step(model):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        began = time.perf_counter()
        if args.helper_ms:
            update_metrics(weights, args.helper_ms)
        helper_s.append(time.perf_counter() - began)
    began = time.perf_counter()
    if args.between_ms:
        log_everything(weights, args.between_ms)
    between_s.append(time.perf_counter() - began)
starts.append(time.perf_counter())
timings.update(startup_s=starts[0] - started, helper_s=helper_s, between_s=between_s, starts=starts)
with open(args.timings, "w") as out:
    json.dump(timings, out)
