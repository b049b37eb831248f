"""A small transformer trained on random tokens on the CPU, for the deep-dive tests."""
import argparse

import torch
from torch import nn

import traceml


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.down(self.act(self.up(self.norm2(x))))


class OutOfMemoryAt(nn.Module):
    """Raises the error an allocation failure raises, once the given step comes."""

    def __init__(self, step):
        super().__init__()
        self.step, self.calls = step, 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return x


class TinyTransformer(nn.Module):
    def __init__(self, vocab, width, blocks, oom_at):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, 4) for _ in range(blocks))
        self.guard = OutOfMemoryAt(oom_at)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.guard(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--deep-every", type=int, default=0, help="trace_model_instance, every N")
    parser.add_argument("--oom-at", type=int, default=10 ** 9)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab = 100
    model = TinyTransformer(vocab, args.width, args.blocks, args.oom_at)
    if args.deep_every:
        traceml.trace_model_instance(model, every_n_steps=args.deep_every)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq))
        with traceml.trace_step(model):
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print(f"trained {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
