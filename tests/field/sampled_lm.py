"""A character-level language model that samples text while it trains: the module the loop trains
wraps its network (`self.net`), and its `generate()`, under @torch.no_grad, calls that inner
network once per new character, never the outer model. An EMA copy of the network is updated in
place after every update and its held-out loss is taken under torch.inference_mode every N steps.
The script times its own sampling, EMA evaluation and EMA updates, to compare with TraceML's.

    python sampled_lm.py --out DIR [--steps 60] [--sample-every 10] [--eval-every 20] [--trace-step]
                         [--compile-ema BACKEND]
"""
import argparse
import copy
import os
import time

import torch
from torch import nn
from torch.nn import functional as F

WORDS = ("the", "cat", "sat", "on", "a", "warm", "mat", "and", "dog", "ran", "to", "its", "bowl")


def corpus(characters, seed):
    """A stream of words, made up, as one string (the "dataset" of the run)."""
    rng = torch.Generator().manual_seed(seed)
    words, length = [], 0
    while length < characters:
        word = WORDS[int(torch.randint(len(WORDS), (1,), generator=rng))]
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:characters]


class CausalBlock(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.feed = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        length = x.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        normed = self.norm1(x)
        x = x + self.attention(normed, normed, normed, attn_mask=mask, need_weights=False)[0]
        return x + self.feed(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab, context, width, depth, heads):
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*(CausalBlock(width, heads) for _ in range(depth)))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        return self.head(self.blocks(x))


class CharLM(nn.Module):
    """What the loop trains: a loss in forward, and sampling that calls the network directly."""

    def __init__(self, vocab, context, width=96, depth=2, heads=4):
        super().__init__()
        self.net = Decoder(vocab, context, width, depth, heads)

    def forward(self, idx, targets):
        logits = self.net(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, prompt, new_characters, temperature=0.8, generator=None):
        idx = prompt
        for _ in range(new_characters):
            logits = self.net(idx[:, -self.net.context:])[:, -1] / temperature
            following = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, following], dim=1)
        return idx


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--sample-characters", type=int, default=48)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--trace-step", action="store_true", help="wrap each step in traceml.trace_step")
    parser.add_argument("--compile-ema", metavar="BACKEND", help="evaluate the EMA copy torch.compile'd")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.trace_step:
        import traceml

    text = corpus(20000, seed=3)
    alphabet = sorted(set(text))
    encode = {character: index for index, character in enumerate(alphabet)}
    data = torch.tensor([encode[character] for character in text])
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]

    torch.manual_seed(0)
    model = CharLM(len(alphabet), args.context)
    ema_net = copy.deepcopy(model.net).requires_grad_(False)
    ema_eval = torch.compile(ema_net, backend=args.compile_ema) if args.compile_ema else ema_net
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = torch.Generator().manual_seed(1)
    sampling = torch.Generator().manual_seed(2)
    spent = {"sample": 0.0, "ema_eval": 0.0, "ema_update": 0.0}

    def batch_of(source):
        starts = torch.randint(len(source) - args.context - 1, (args.batch,), generator=batches)
        chunk = torch.stack([source[start:start + args.context + 1] for start in starts.tolist()])
        return chunk[:, :-1], chunk[:, 1:]

    def train_step(inputs, targets):
        loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    samples = []
    for step in range(args.steps):
        inputs, targets = batch_of(train)
        if args.trace_step:
            with traceml.trace_step(model):
                loss = train_step(inputs, targets)
        else:
            loss = train_step(inputs, targets)

        started = time.perf_counter()
        with torch.no_grad():  # the EMA update: arithmetic on the weights, no model run
            for averaged, current in zip(ema_net.parameters(), model.net.parameters()):
                averaged.lerp_(current, 0.05)
        spent["ema_update"] += time.perf_counter() - started

        if (step + 1) % args.sample_every == 0:
            started = time.perf_counter()
            prompt = data[:4].unsqueeze(0)
            sample = model.generate(prompt, args.sample_characters, generator=sampling)
            spent["sample"] += time.perf_counter() - started
            samples.append("".join(alphabet[index] for index in sample[0].tolist()))
            print(f"step {step + 1}: loss {loss.item():.3f} sample {samples[-1]!r}")
        if (step + 1) % args.eval_every == 0:
            started = time.perf_counter()
            with torch.inference_mode():
                inputs, targets = batch_of(held_out)
                logits = ema_eval(inputs)
                ema_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            spent["ema_eval"] += time.perf_counter() - started
            print(f"step {step + 1}: ema held-out loss {ema_loss.item():.3f}")

    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))
    torch.save(ema_net.state_dict(), os.path.join(args.out, "ema.pt"))
    with open(os.path.join(args.out, "samples.txt"), "w") as handle:
        handle.write("\n".join(samples) + "\n")
    print(f"sampling took {spent['sample'] * 1e3:.1f} ms, ema evaluation {spent['ema_eval'] * 1e3:.1f} ms, "
          f"ema updates {spent['ema_update'] * 1e3:.1f} ms")
    if args.compile_ema:
        from torch._dynamo.utils import counters

        print(f"compiled graphs {counters['stats']['unique_graphs']}")
    print(f"updates {args.steps}")


if __name__ == "__main__":
    main()
