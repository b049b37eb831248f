"""An autoencoder whose encoder and decoder are separate modules under one optimizer, called one
after the other in the loop (as two-tower and encoder-decoder scripts do); a DataLoader with
shuffling; both state_dicts saved together.

    python autoencoder.py --out DIR [--epochs 2]
"""
import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(6)
    encoder = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 8))
    decoder = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 24))
    optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-3)
    data = torch.randn(512, 24)
    loader = DataLoader(TensorDataset(data), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    updates = 0
    for epoch in range(args.epochs):
        for (batch,) in loader:
            loss = nn.functional.mse_loss(decoder(encoder(batch)), batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1
        print(f"epoch {epoch}: loss {loss.item():.5f}")
    torch.save({"encoder": encoder.state_dict(), "decoder": decoder.state_dict()},
               os.path.join(args.out, "autoencoder.pt"))
    print(f"updates {updates}")


if __name__ == "__main__":
    main()
