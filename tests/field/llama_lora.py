"""LoRA fine-tune of a small Llama-style decoder: pre-norm blocks with RMSNorm, rotary position
embeddings, causal attention and a SwiGLU feed-forward. The "pretrained" base is built from a
fixed seed and frozen; low-rank adapters go on the query and value projections, and only their
weights are trained (AdamW, warm-up then cosine decay, gradient clipping) and saved.

    python llama_lora.py --out DIR [--steps 24]

Writes DIR/adapter.pt (the adapters' state_dict) and DIR/adapter_config.json.
"""
import argparse
import json
import math
import os

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, HEADS, BLOCKS, CONTEXT = 256, 64, 4, 2, 32


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, hidden):
        scale = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return hidden * scale * self.weight


def rotary_tables(length, head_width, base=10000.0):
    """cos and sin of each position's angle per pair of channels, (length, head_width / 2)."""
    inverse = 1.0 / base ** (torch.arange(0, head_width, 2).float() / head_width)
    angles = torch.outer(torch.arange(length).float(), inverse)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class LoRALinear(nn.Module):
    """A frozen projection plus a trainable low-rank update, B(A(x)) * alpha / rank; B starts
    at zero so the adapted model starts as the base."""

    def __init__(self, base: nn.Linear, rank=8, alpha=16):
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scaling


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.o_proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, hidden, cos, sin):
        batch, length, _ = hidden.shape
        split = lambda t: t.view(batch, length, HEADS, WIDTH // HEADS).transpose(1, 2)  # noqa: E731
        query = rotate(split(self.q_proj(hidden)), cos, sin)
        key = rotate(split(self.k_proj(hidden)), cos, sin)
        mixed = F.scaled_dot_product_attention(query, key, split(self.v_proj(hidden)), is_causal=True)
        return self.o_proj(mixed.transpose(1, 2).reshape(batch, length, WIDTH))


class FeedForward(nn.Module):
    def __init__(self, hidden_width=4 * WIDTH):
        super().__init__()
        self.gate_proj = nn.Linear(WIDTH, hidden_width, bias=False)
        self.up_proj = nn.Linear(WIDTH, hidden_width, bias=False)
        self.down_proj = nn.Linear(hidden_width, WIDTH, bias=False)

    def forward(self, hidden):
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm = RMSNorm(WIDTH)
        self.attention = Attention()
        self.post_attention_norm = RMSNorm(WIDTH)
        self.mlp = FeedForward()

    def forward(self, hidden, cos, sin):
        hidden = hidden + self.attention(self.input_norm(hidden), cos, sin)
        return hidden + self.mlp(self.post_attention_norm(hidden))


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(BLOCKS))
        self.norm = RMSNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        cos, sin = rotary_tables(CONTEXT, WIDTH // HEADS)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def forward(self, input_ids):
        length = input_ids.shape[1]
        cos, sin = self.rotary_cos[:length], self.rotary_sin[:length]
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.lm_head(self.norm(hidden))


def add_adapters(model, targets=("q_proj", "v_proj"), rank=8, alpha=16):
    """Freeze the base and wrap each target projection in a LoRALinear."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for layer in model.layers:
        for name in targets:
            setattr(layer.attention, name, LoRALinear(getattr(layer.attention, name), rank, alpha))
    return {"targets": list(targets), "rank": rank, "alpha": alpha}


def adapter_state(model):
    return {name: tensor for name, tensor in model.state_dict().items() if ".lora_" in name}


def token_batches(steps, batch_size, generator):
    """A corpus with structure to learn: each row counts up from a random start, with noise."""
    for _ in range(steps):
        starts = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
        rows = (starts + torch.arange(CONTEXT + 1)) % VOCAB
        noise = torch.rand(rows.shape, generator=generator) < 0.1
        rows[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=generator)
        yield rows[:, :-1], rows[:, 1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(0)
    model = TinyLlama()  # stands in for the pretrained checkpoint
    config = add_adapters(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps))))

    model.train()
    for step, (inputs, targets) in enumerate(token_batches(args.steps, args.batch_size,
                                                           torch.Generator().manual_seed(1))):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        if step % 8 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.6f}  lr {schedule.get_last_lr()[0]:.2e}")

    torch.save(adapter_state(model), os.path.join(args.out, "adapter.pt"))
    with open(os.path.join(args.out, "adapter_config.json"), "w") as out:
        json.dump({**config, "base": "TinyLlama", "trainable_parameters": sum(p.numel() for p in trainable)},
                  out, indent=2)
    print(f"updates {args.steps}")


if __name__ == "__main__":
    main()
