"""A real DDP training loop (gloo, CPU) the distributed tests run, one rank slowed on request."""
import argparse
import io
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import traceml
from synthetic_data import SyntheticDataset


class Net(nn.Module):
    def __init__(self, busy_ms):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                  nn.Linear(256, 10))
        self.busy_s = busy_ms / 1000.0
        self.spin = torch.randn(128, 128)

    def forward(self, inputs):
        if self.busy_s:  # real extra compute on this rank, not a sleep
            # A fixed amount of work: busy_s of this thread's own CPU time, which a busy
            # machine stretches as it would a real model's, not busy_s of the wall clock.
            deadline = time.thread_time() + self.busy_s
            while time.thread_time() < deadline:
                self.spin = torch.tanh(self.spin @ self.spin)
        return self.body(inputs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--load-ms", type=float, default=0.0, help="per sample, on the slow rank")
    parser.add_argument("--busy-ms", type=float, default=0.0, help="extra forward, on the slow rank")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="between steps, on the slow rank")
    parser.add_argument("--exit-code", type=int, default=0, help="the slow rank's, once all is done")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # A two-node test marks the node whose rank is slow: c10d orders the ranks of nodes itself.
    slow = rank == args.slow_rank or os.environ.get("DDP_LOOP_SLOW") == "1"
    torch.manual_seed(0)
    model = DistributedDataParallel(Net(args.busy_ms if slow else 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(SyntheticDataset(args.steps * args.batch_size, 32, args.load_ms if slow else 0.0, seed=rank),
                        batch_size=args.batch_size)
    for step, (inputs, targets) in enumerate(loader):
        with traceml.trace_step(model):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if slow and args.sleep_ms:  # its own business between steps: logging, a metric, a sync
            time.sleep(args.sleep_ms / 1000.0)
    print(f"rank {rank} trained {step + 1} steps", flush=True)
    if rank == 0:  # the wrapper pickles as it would untraced, and names no traceml
        saved = io.BytesIO()
        torch.save(model, saved)
        print(f"rank 0 saved the DDP model, traceml in it: {b'traceml' in saved.getvalue()}", flush=True)
    # Both ranks done before either leaves: a rank that leaves while the other is still in its
    # last all-reduce can abort it. No destroy_process_group() after that barrier: on a loaded
    # machine gloo's teardown there aborted one rank about one run in ten, with TraceML or
    # without; at process exit it does so far more rarely (tests/conftest.py: GLOO_EXIT_ABORT).
    dist.barrier()
    if slow and args.exit_code:
        sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
