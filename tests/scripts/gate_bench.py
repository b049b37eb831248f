"""A short benchmark for the regression gate's tests: each step the same matmul work, ten layers
deep, or --layers of them to make it slower. No sleeps: a neighbour's load coarsens a short sleep
to the scheduler's tick, which a CI runner's benchmark should not be at the mercy of. One thread,
so that the training and one busy neighbour each have a core of a 2-core machine."""
import argparse

import torch
from torch import nn

import traceml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(64, 256)
    for _ in range(args.steps):
        with traceml.trace_step(model):
            out = inputs
            for _ in range(args.layers):
                out = torch.tanh(model(out))
            loss = out.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
