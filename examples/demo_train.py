"""A small CPU training run to try TraceML on: an MLP fed by a deliberately slow Dataset.

    traceml run examples/demo_train.py                 # INPUT_BOUND: the loader is slow
    traceml run examples/demo_train.py --load-ms 0     # COMPUTE_BOUND once the loader is fixed
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import traceml


class SlowDataset(Dataset):
    """Synthetic samples that each take `load_ms` to "decode", like images read from disk."""

    def __init__(self, size: int, features: int, load_ms: float):
        self.inputs = torch.randn(size, features)
        self.targets = torch.randint(0, 10, (size,))
        self.load_s = load_ms / 1000.0

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        if self.load_s:
            time.sleep(self.load_s)
        return self.inputs[index], self.targets[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--load-ms", type=float, default=1.0, help="per-sample loading time")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SlowDataset(args.steps * args.batch_size, 256, args.load_ms)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)

    for step, (inputs, targets) in enumerate(loader):
        with traceml.trace_step(model):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
