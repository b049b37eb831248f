"""A training loop pinned to one core; with --neighbour, a busy process pinned to the same core.
It writes its own count of the loop's time on a CPU and wait for one, from step 1 on, to
own_cpu.json in the working directory."""
import argparse
import json
import os
import threading
import time
import subprocess
import sys

import torch
from torch import nn

import traceml

NEIGHBOUR = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def own_counts():
    """This thread's time on a CPU (its own clock) and its wait for one (Linux's schedstat), in ms."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as schedstat:
        waited_ns = int(schedstat.read().split()[1])
    return time.thread_time() * 1e3, waited_ns / 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--neighbour", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(core)]) if args.neighbour else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(64, 256)
    try:
        for step in range(args.steps):
            if step == 1:  # step 0 began before TraceML's first reading of this thread
                own_start = own_counts()
            with traceml.trace_step(model):
                loss = model(inputs).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        own_end = own_counts()
        with open("own_cpu.json", "w") as out:
            json.dump({"on_cpu_ms": own_end[0] - own_start[0], "cpu_wait_ms": own_end[1] - own_start[1]}, out)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


if __name__ == "__main__":
    main()
