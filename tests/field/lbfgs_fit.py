"""Full-batch fitting with L-BFGS, as small regression and physics-informed scripts do:
optimizer.step(closure), where the optimizer calls the closure (forward and backward) several
times an update; the fitted state_dict is saved.

    python lbfgs_fit.py --out DIR [--updates 15]
"""
import argparse
import os

import torch
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=15)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(4)
    x = torch.linspace(-2, 2, 256).unsqueeze(1)
    y = torch.sin(3 * x) + 0.5 * x
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=10)

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for update in range(args.updates):
        loss = optimizer.step(closure)
        if update % 5 == 0:
            print(f"update {update}: loss {loss.item():.6f}")
    torch.save(model.state_dict(), os.path.join(args.out, "fit.pt"))
    print(f"updates {args.updates}")


if __name__ == "__main__":
    main()
