"""A GPT-style model whose per-layer truth is known, trained the plain way: pre-norm blocks with
residual connections, attention through F.scaled_dot_product_attention, nn.Dropout(p=0.0) after
the attention and MLP projections (as many GPT scripts leave them), and the output head tied to
the token embedding. Also importable: the tests time its layers alone against deep-dive.

    python gpt_deep.py [--steps 40] [--blocks 2] [--width 128] [--batch 8] [--context 64]
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop1 = nn.Dropout(0.0)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop1(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop2(self.down(self.act(self.up(self.norm2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, context: int = 64, width: int = 128, blocks: int = 2, heads: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # weight tying

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(context=args.context, width=args.width, blocks=args.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, 256, (args.steps, args.batch, args.context + 1))
    for step in range(args.steps):
        inputs, targets = data[step, :, :-1], data[step, :, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print("trained", args.steps, "steps")


if __name__ == "__main__":
    main()
