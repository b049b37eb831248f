"""Two loops that reshape the model while it trains: one moves it with model.to(device, dtype)
after its first step (optimizer state and all, as resumed or late-placed runs do), the other
replaces model.forward on the instance (a wrapper adding noise to the input, as some
regularisation and activation-checkpointing code does). Both save torch.save(model) and the
state_dict at the end.

    python moved_model.py --out DIR --how late-to|own-forward [--steps 30]
"""
import argparse
import functools
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh())
        self.out = nn.Linear(48, 1)

    def forward(self, inputs):
        return self.out(self.body(inputs))


def noisy_forward(model, original, inputs):
    """Input noise, applied by replacing the instance's forward (only while training)."""
    if model.training:
        inputs = inputs + 0.01 * torch.randn_like(inputs)
    return original(inputs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--how", choices=("late-to", "own-forward"), required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(2)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Regressor()
    if args.how == "own-forward":
        model.forward = functools.partial(noisy_forward, model, model.forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs = torch.randn(args.steps * 16, 12)
    targets = inputs[:, :3].sum(dim=1, keepdim=True).sin()
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=16)
    dtype = torch.float32

    for step, (batch, target) in enumerate(loader):
        batch, target = batch.to(device, dtype), target.to(device, dtype)
        loss = nn.functional.mse_loss(model(batch), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0 and args.how == "late-to":
            dtype = torch.float64  # placed (and widened) only once training has started
            model.to(device, dtype)
            for state in optimizer.state.values():
                state["momentum_buffer"] = state["momentum_buffer"].to(device, dtype)
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.5f}")
    model.eval()
    with torch.no_grad():
        print(f"final loss {nn.functional.mse_loss(model(inputs.to(device, dtype)), targets.to(device, dtype)).item():.5f}")
    if args.how == "own-forward":
        del model.forward  # the instance's wrapper is the script's own: saved without it
    torch.save(model, os.path.join(args.out, "model.pt"))
    torch.save(model.state_dict(), os.path.join(args.out, "state.pt"))
    print(f"updates {len(loader)}")


if __name__ == "__main__":
    main()
