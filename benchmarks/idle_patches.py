"""What TraceML's patches cost code that runs outside the traced steps: evaluation, data prep.

TraceML patches torch (Tensor.to, autograd.backward, the DataLoader iterator, the traced model's
class, optimizer hooks, torch.save) and queue.Queue.get for as long as a run is traced. Code outside the steps goes
through those patches too. Each operation below runs in blocks with TraceML attached (patches in,
the model hooked, no step open) and detached (torch as it was), the blocks in a shuffled order in
one process; the figure is the median per call on each side and the difference.

    python benchmarks/idle_patches.py [--calls 2000] [--blocks 20]
"""
from __future__ import annotations

import argparse
import os
import queue
import random
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per block")
    parser.add_argument("--blocks", type=int, default=20, help="blocks on each side, per operation")
    args = parser.parse_args()
    os.environ.setdefault("TRACEML_RUN_DIR", tempfile.mkdtemp(prefix="traceml-idle-"))

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import traceml
    from traceml.probe import process as probe_process

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Model(nn.Sequential):
        pass

    model = Model(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    other = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(other.parameters(), lr=0.01)
    inputs = torch.randn(8, 32)
    rows = 8 * (args.calls + 50) * args.blocks * 2 + 64  # every block of both loaders
    data = TensorDataset(torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
    loaders = {"grad": iter(DataLoader(data, batch_size=8)), "no_grad": iter(DataLoader(data, batch_size=8))}

    def to_dtype() -> None:
        inputs.to(torch.float64)

    def traced_model_no_grad() -> None:  # an evaluation loop calling the traced model
        with torch.no_grad():
            model(inputs)

    def other_module() -> None:
        other(inputs)

    def backward_and_step() -> None:  # a second model trained outside the steps (a probe, an EMA)
        loss = other(inputs).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def loader_next() -> None:  # data prep with gradients on
        next(loaders["grad"])

    def loader_next_no_grad() -> None:  # an evaluation loop's batches
        with torch.no_grad():
            next(loaders["no_grad"])

    buffer: queue.Queue = queue.Queue()

    def queue_get() -> None:  # a prefetching thread's buffer, as the training thread takes from it
        buffer.put(None)
        buffer.get()

    operations = {"Tensor.to(dtype)": to_dtype, "traced model, no_grad": traced_model_no_grad,
                  "another module": other_module, "backward + optimizer.step": backward_and_step,
                  "DataLoader next": loader_next, "DataLoader next, no_grad": loader_next_no_grad,
                  "queue.Queue put + get": queue_get}

    with traceml.trace_step(model):  # starts the probe and hooks the model
        model(inputs)

    def attach(attached: bool) -> None:
        if attached:
            with traceml.trace_step(model):  # attaches again after a detach
                pass
        else:
            probe_process.detach()

    print(f"{args.blocks} blocks of {args.calls} calls on each side, shuffled; µs per call (median of blocks)")
    print(f"  {'operation':28s} {'detached':>9s} {'attached':>9s} {'added':>8s} {'ratio':>7s}")
    for name, operation in operations.items():
        order = [True] * args.blocks + [False] * args.blocks
        random.Random(name).shuffle(order)
        per_call = {True: [], False: []}
        for attached in order:
            attach(attached)
            for _ in range(50):  # the interpreter's caches refill after a patch changes
                operation()
            start = time.perf_counter_ns()
            for _ in range(args.calls):
                operation()
            per_call[attached].append((time.perf_counter_ns() - start) / args.calls / 1e3)
        detached, attached_us = statistics.median(per_call[False]), statistics.median(per_call[True])
        print(f"  {name:28s} {detached:9.2f} {attached_us:9.2f} {attached_us - detached:+8.2f} "
              f"{attached_us / detached:7.3f}")
    attach(True)


if __name__ == "__main__":
    main()
