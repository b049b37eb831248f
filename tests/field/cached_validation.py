"""A sensor-signal classifier whose validation set is kept as CSV text and decoded lazily: the
Dataset parses and normalises a row the first time it is asked for and keeps the tensor, so
the first evaluation reads the whole file (ten times longer or more than the others) and every
later one reads memory. Training batches are sliced
out of in-memory tensors by a shuffled permutation (no DataLoader); evaluation runs every N
updates over a DataLoader, under model.eval() and torch.no_grad().

    python cached_validation.py --out DIR [--updates 120] [--eval-every 10]
"""
import argparse
import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SIGNAL = 512  # readings per sample
CLASSES = 10


class CsvSignals(Dataset):
    """One sample a line: its label, then its readings, comma-separated. Decoded on first use."""

    def __init__(self, path):
        with open(path) as source:
            self.lines = source.read().splitlines()
        self.decoded = {}

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, index):
        if index not in self.decoded:
            label, *readings = self.lines[index].split(",")
            signal = torch.tensor([float(value) for value in readings])
            signal = (signal - signal.mean()) / (signal.std() + 1e-6)
            self.decoded[index] = (signal, int(label))
        return self.decoded[index]


def make_signals(rng, count, prototypes):
    labels = rng.integers(0, CLASSES, size=count)
    noise = rng.normal(0.0, 1.0, size=(count, SIGNAL)).astype(np.float32)
    return prototypes[labels] + noise, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--val-rows", type=int, default=512)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    rng = np.random.default_rng(7)
    prototypes = rng.normal(0.0, 0.06, size=(CLASSES, SIGNAL)).astype(np.float32)
    train_x, train_y = make_signals(rng, 4096, prototypes)
    val_x, val_y = make_signals(rng, args.val_rows, prototypes)
    val_path = os.path.join(args.out, "val.csv")
    with open(val_path, "w") as sink:
        for label, row in zip(val_y, val_x):
            sink.write(f"{label}," + ",".join(f"{value:.4f}" for value in row) + "\n")

    torch.manual_seed(7)
    inputs = torch.from_numpy(train_x)
    inputs = (inputs - inputs.mean(dim=1, keepdim=True)) / (inputs.std(dim=1, keepdim=True) + 1e-6)
    targets = torch.from_numpy(train_y)
    validation = DataLoader(CsvSignals(val_path), batch_size=256)

    model = nn.Sequential(nn.Linear(SIGNAL, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def evaluate():
        model.eval()
        correct = 0
        with torch.no_grad():
            for signal, label in validation:
                correct += (model(signal).argmax(dim=1) == label).sum().item()
        model.train()
        return correct / len(validation.dataset)

    order = torch.randperm(len(inputs))
    cursor = 0
    for update in range(args.updates):
        if cursor + args.batch > len(order):
            order, cursor = torch.randperm(len(inputs)), 0
        batch = order[cursor:cursor + args.batch]
        cursor += args.batch
        loss = loss_fn(model(inputs[batch]), targets[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (update + 1) % args.eval_every == 0:
            print(f"update {update + 1}: loss {loss.item():.4f}, val accuracy {evaluate():.3f}")
    torch.save(model.state_dict(), os.path.join(args.out, "classifier.pt"))
    print(f"updates {args.updates}")


if __name__ == "__main__":
    main()
