"""A loop written for Hugging Face Accelerate: prepared model, optimizer and DataLoader, and
accelerator.backward; traced with trace_step (or, with --untraced, by zero-code mode); with
--fsdp, each Linear sharded by Accelerate's FSDP2 plugin."""
import argparse
import time

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __init__(self, sleep_ms):
        self.sleep_ms = sleep_ms

    def __len__(self):
        return 100_000

    def __getitem__(self, index):
        time.sleep(self.sleep_ms / 1000.0)
        return torch.randn(32), torch.randn(1)


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--load-ms", type=float, default=1.0)
parser.add_argument("--untraced", action="store_true")
parser.add_argument("--fsdp", action="store_true")
args = parser.parse_args()

plugin = None
if args.fsdp:
    from accelerate import FullyShardedDataParallelPlugin
    from cpu_fsdp import let_accelerate_shard_on_cpu

    let_accelerate_shard_on_cpu()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=1000)
accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(Slow(args.load_ms), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
if not args.untraced:
    import traceml
batches = iter(loader)
for step in range(args.steps):
    if args.untraced:
        inputs, targets = next(batches)
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        continue
    with traceml.trace_step(model):
        inputs, targets = next(batches)
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
# One string, one write: both ranks print to one stdout, and print()'s separate arguments interleave.
print(f"done {args.steps} sharded parameters: {sum(hasattr(p, '_local_tensor') for p in model.parameters())}")
