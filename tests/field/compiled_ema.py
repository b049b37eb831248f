"""A compiled model with the extras of a modern recipe: torch.compile, an EMA copy made with
copy.deepcopy and updated in place after each step, a warm-up-then-cosine LR scheduler, weight
tying between the token embedding and the output head, evaluation of the EMA weights under
torch.inference_mode every N steps, and the raw model, its state_dict and the EMA's saved.

    python compiled_ema.py --out DIR [--steps 30] [--backend inductor]
"""
import argparse
import copy
import os

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        hidden = hidden + self.mix(hidden)
        return self.head(self.norm(hidden))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--eval-every", type=int, default=10)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)

    model = TinyLM()
    ema = copy.deepcopy(model).requires_grad_(False)
    compiled = torch.compile(model, backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps - 5)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[5])
    data = torch.randint(0, 64, (args.steps, 16, 12), generator=torch.Generator().manual_seed(1))

    for step in range(args.steps):
        tokens = data[step]
        logits = compiled(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for averaged, current in zip(ema.parameters(), model.parameters()):
                averaged.lerp_(current, 0.1)
        if step % args.eval_every == 0:
            with torch.inference_mode():
                ema_loss = nn.functional.cross_entropy(ema(data[0, :, :-1]).reshape(-1, 64),
                                                       data[0, :, 1:].reshape(-1))
            print(f"step {step}: loss {loss.item():.4f} ema {ema_loss.item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.5f}")
    torch.save(model, os.path.join(args.out, "model.pt"))
    torch.save(model.state_dict(), os.path.join(args.out, "state.pt"))
    torch.save(ema.state_dict(), os.path.join(args.out, "ema.pt"))
    from torch._dynamo.utils import counters

    print(f"compiled graphs {counters['stats']['unique_graphs']}, "
          f"graph breaks {sum(counters['graph_break'].values())}")
    print(f"updates {args.steps}")


if __name__ == "__main__":
    main()
