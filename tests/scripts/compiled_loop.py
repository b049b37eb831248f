"""A torch.compile'd model trained on token sequences, fed fixed or changing lengths: the loop
a user writes before bucketing by length. It never imports traceml (zero-code mode)."""
import argparse
import time

import torch
from torch import nn


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    graph_break = False

    def forward(self, tokens):
        hidden = torch.relu(self.mix(self.embed(tokens)))
        if self.graph_break:
            torch._dynamo.graph_break()  # what a print or a .item() in forward does
        return self.head(hidden.mean(dim=1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lengths", choices=("fixed", "growing"), default="fixed",
                        help="growing: from step 10 a new, longer sequence length every 4 steps")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--graph-break", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyEncoder()
    model.graph_break = args.graph_break
    compiled = torch.compile(model, backend=args.backend, dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    for step in range(args.steps):
        length = 16 if args.lengths == "fixed" or step < 10 else 16 + 1 + (step - 10) // 4
        tokens = torch.randint(0, 64, (8, length))
        targets = torch.randint(0, 64, (8,))
        loss = nn.functional.cross_entropy(compiled(tokens), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"trained {args.steps} steps in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
