"""A training loop fed by a thread that makes its batches ahead of it: MONAI's ThreadDataLoader, or
a hand-written prefetcher (a thread iterating a DataLoader into a queue.Queue). The batches take
--make-ms each to make; the step takes about --step-ms. The loop times its own next() calls and
steps with perf_counter and writes them to --out, to compare with TraceML's input wait."""
import argparse
import json
import queue
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

import traceml
from synthetic_data import SyntheticDataset


class Prefetcher:
    """Iterates a DataLoader on a thread of its own into a bounded queue; yields from the queue."""

    def __init__(self, loader, depth=2):
        self.batches = queue.Queue(maxsize=depth)
        threading.Thread(target=self._fill, args=(loader,), daemon=True).start()

    def _fill(self, loader):
        for batch in loader:
            self.batches.put(batch)
        self.batches.put(None)

    def __iter__(self):
        while (batch := self.batches.get()) is not None:
            yield batch


class Device(nn.Module):
    """The model's work on an accelerator, as the host sees it: step_ms in the forward."""

    def __init__(self, step_ms):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.step_s = step_ms / 1000.0

    def forward(self, inputs):
        time.sleep(self.step_s)
        return self.layers(inputs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=("monai", "queue"), required=True)
    parser.add_argument("--make-ms", type=float, required=True, help="the producer's time to make a batch")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Device(args.step_ms)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = SyntheticDataset(args.steps * args.batch_size, 32, args.make_ms / args.batch_size)
    if args.loader == "monai":
        from monai.data import ThreadDataLoader

        batches = iter(ThreadDataLoader(dataset, batch_size=args.batch_size))
    else:
        batches = iter(Prefetcher(DataLoader(dataset, batch_size=args.batch_size)))
    fetch_s, enter_s, exit_s = [], [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        inputs, targets = next(batches)
        enter_s.append(time.perf_counter())
        fetch_s.append(enter_s[-1] - started)
        with traceml.trace_step(model):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        exit_s.append(time.perf_counter())
    with open(args.out, "w") as out:
        json.dump({"fetch_s": fetch_s, "enter_s": enter_s, "exit_s": exit_s}, out)


if __name__ == "__main__":
    main()
