"""A training loop pinned to one core; with --neighbour, a busy process pinned to the same core."""
import argparse
import os
import subprocess
import sys

import torch
from torch import nn

import traceml

NEIGHBOUR = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


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
        for _ in range(args.steps):
            with traceml.trace_step(model):
                loss = model(inputs).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


if __name__ == "__main__":
    main()
