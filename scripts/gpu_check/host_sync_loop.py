"""GPU check: a CUDA loop that reads its loss with `.item()` every step (a host sync a step), for
the HOST_SYNC finding; the gpu check finds that call's line by its marker comment."""
import argparse

import torch
from torch import nn

import traceml


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")  # TF32: fp32 products on tensor cores
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, 1)).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    inputs = torch.randn(args.batch, args.width, device=args.device)
    losses = []
    for _ in range(args.steps):
        with traceml.trace_step(model):
            loss = model(inputs).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # HOST_SYNC_SITE: the host waits for the device here
    print(f"trained {args.steps} steps, last loss {losses[-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
