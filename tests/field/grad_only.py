"""A loop with neither optimizer.step() nor backward(): gradients from torch.autograd.grad and
an update applied by hand, as meta-learning inner loops and some research code do. TraceML
cannot find its steps by itself, and must say so rather than invent them.

    python grad_only.py --out DIR [--steps 20]
"""
import argparse
import os

import torch
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    parameters = list(model.parameters())
    inputs = torch.randn(args.steps, 32, 6)
    targets = inputs.sum(dim=2, keepdim=True).cos()
    for step in range(args.steps):
        loss = nn.functional.mse_loss(model(inputs[step]), targets[step])
        gradients = torch.autograd.grad(loss, parameters)
        with torch.no_grad():
            for parameter, gradient in zip(parameters, gradients):
                parameter -= 0.1 * gradient
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item():.5f}")
    torch.save(model.state_dict(), os.path.join(args.out, "state.pt"))


if __name__ == "__main__":
    main()
