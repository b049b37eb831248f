"""A training script that never imports traceml: `traceml run` traces it anyway (zero-code)."""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--collate-ms", type=float, default=0.0)
parser.add_argument("--device", default="cpu")
args = parser.parse_args()


def slow_collate(rows):
    time.sleep(args.collate_ms / 1000.0)
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(args.device)
loss_fn = nn.MSELoss()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
loader = DataLoader(data, batch_size=16, collate_fn=slow_collate if args.collate_ms else None)
batches = iter(loader)
with torch.no_grad():  # a look at the model before training: not a step
    model(torch.randn(2, 32, device=args.device))
for step in range(args.steps):
    inputs, targets = (tensor.to(args.device, non_blocking=True) for tensor in next(batches))
    loss = loss_fn(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"trained {args.steps} steps, loss {loss.item():.3f}")
