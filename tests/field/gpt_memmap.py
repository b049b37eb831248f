"""A small GPT trained the way many single-file GPT scripts do it: token batches sliced out of
an np.memmap (no DataLoader), gradient accumulation by micro-steps, a GradScaler, evaluation
under no_grad every N iterations, and a checkpoint dict saved with torch.save.

    python gpt_memmap.py --out DIR [--iters 30] [--accumulate 4] [--eval-every 10]
"""
import argparse
import math
import os
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab, context, width, depth, heads):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # weight tying
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets=None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    # The "prepared dataset": uint16 token ids on disk, read back through a memmap.
    vocab = 96
    rng = np.random.default_rng(1337)
    for split, size in (("train", 20000), ("val", 4000)):
        rng.integers(0, vocab, size=size, dtype=np.uint16).tofile(os.path.join(args.out, f"{split}.bin"))

    torch.manual_seed(1337)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def get_batch(split):
        data = np.memmap(os.path.join(args.out, f"{split}.bin"), dtype=np.uint16, mode="r")
        starts = torch.randint(len(data) - args.context - 1, (args.batch,))
        x = torch.stack([torch.from_numpy(data[i:i + args.context].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.context].astype(np.int64)) for i in starts])
        return x.to(device), y.to(device)

    model = GPT(vocab, args.context, width=48, depth=2, heads=4).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler(device, enabled=True)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        losses = {}
        for split in ("train", "val"):
            values = [model(*get_batch(split))[1].item() for _ in range(4)]
            losses[split] = sum(values) / len(values)
        model.train()
        return losses

    def learning_rate(iteration):
        warmup = 5
        if iteration < warmup:
            return 3e-3 * (iteration + 1) / warmup
        return 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * iteration / args.iters))

    X, Y = get_batch("train")
    started = time.time()
    for iteration in range(args.iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(iteration)
        if iteration % args.eval_every == 0:
            losses = estimate_loss()
            print(f"step {iteration}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "iter_num": iteration, "val_loss": losses["val"]},
                       os.path.join(args.out, "ckpt.pt"))
        if iteration == args.iters:
            break
        for micro_step in range(args.accumulate):
            _, loss = model(X, Y)
            loss = loss / args.accumulate
            X, Y = get_batch("train")  # the next micro-batch, fetched while this one is in flight
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        elapsed_ms = (time.time() - started) * 1000
        started = time.time()
        if iteration % 5 == 0:
            print(f"iter {iteration}: loss {loss.item() * args.accumulate:.4f}, time {elapsed_ms:.2f}ms")
    print(f"updates {args.iters}")


if __name__ == "__main__":
    main()
