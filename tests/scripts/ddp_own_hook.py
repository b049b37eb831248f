"""One DDP rank (gloo, a file store) whose script registers its own communication hook, before
its first step or after a few traced ones; prints how many steps had their collective wait."""
import argparse
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import traceml

parser = argparse.ArgumentParser()
parser.add_argument("--own-hook", choices=("before", "after", "none"), default="none")
args = parser.parse_args()

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train(steps):
    for _ in range(steps):
        with traceml.trace_step(model):
            loss = model(torch.randn(4, 8)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if args.own_hook == "before":
    model.register_comm_hook(None, allreduce_hook)
train(5)
if args.own_hook == "after":  # DDP takes one hook: this fails if TraceML had registered one
    model.register_comm_hook(None, allreduce_hook)
train(20)
from traceml.probe import step as probe_step  # noqa: E402

records = probe_step._probe.sender.local_steps()
waited = sum(record.comm_wait_ms is not None and record.comm_wait_ms > 0 for record in records)
print(f"steps {len(records)} with collective wait {waited}")
dist.destroy_process_group()
