"""What a memory ledger reading costs the training thread, on a model with as many parameter
tensors as a 7B Llama fine-tuned with LoRA on q_proj and v_proj (32 blocks: 291 base tensors,
128 adapter tensors, AdamW state for the adapters), beside the step it runs between.

A reading's cost grows with the number of tensors, not their size, so the tensors here are
small. Readings and training steps alternate in one process; the figures printed are each
one's median, and the share of the training thread's time that a reading every
READING_INTERVAL_S takes (steps slower than that get one at each start: no larger a share).

    python benchmarks/ledger_reading.py [--blocks 32] [--rounds 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from traceml.probe.ledger import READING_INTERVAL_S, LedgerWatch

WIDTH = 16
LORA_R = 4


class AdaptedLinear(nn.Module):
    """A frozen Linear with a LoRA pair beside it, named as PEFT names them."""

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(WIDTH, WIDTH, bias=False).requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(WIDTH, LORA_R, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(LORA_R, WIDTH, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.v_proj = AdaptedLinear(), AdaptedLinear()
        frozen = [nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(5)]
        self.k_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj = frozen
        self.input_norm, self.post_norm = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
        for module in [*frozen, self.input_norm, self.post_norm]:
            module.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_norm(x)
        x = x + self.o_proj(self.q_proj(h) * torch.sigmoid(self.k_proj(h)) + self.v_proj(h))
        h = self.post_norm(x)
        return x + self.down_proj(torch.relu(self.gate_proj(h)) * self.up_proj(h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32, help="transformer blocks (a 7B Llama has 32)")
    parser.add_argument("--rounds", type=int, default=200, help="readings and steps, alternating")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Embedding(64, WIDTH).requires_grad_(False), *[Block() for _ in range(args.blocks)],
                          nn.Linear(WIDTH, 64, bias=False).requires_grad_(False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tokens = torch.randint(0, 64, (4, 32))

    def step() -> None:
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    ledger = LedgerWatch(rank=0)
    ledger.watch_model(model)
    ledger.watch_optimizer(optimizer)
    step()
    reading = ledger.reading(step=1)
    assert reading is not None and reading.adapter_parameter_bytes, "the adapters were not found"
    reading_s, step_s = [], []
    for round_index in range(args.rounds):
        started = time.perf_counter()
        ledger._last_sent = None  # a reading is always built and compared in full
        ledger.reading(step=round_index + 2)
        reading_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - started)
    tensors = sum(1 for _ in model.parameters()) + sum(len(s) for s in optimizer.state.values())
    reading_ms, step_ms = statistics.median(reading_s) * 1e3, statistics.median(step_s) * 1e3
    print(f"{args.blocks} blocks, {tensors} tensors (parameters and optimizer state), {args.rounds} rounds")
    print(f"reading   median {reading_ms:.3f} ms  (p90 {sorted(reading_s)[int(0.9 * len(reading_s))] * 1e3:.3f} ms)")
    print(f"step      median {step_ms:.3f} ms on this CPU")
    print(f"one reading every {READING_INTERVAL_S:g} s: {reading_ms / (READING_INTERVAL_S * 1e3):.4%} of the "
          f"training thread's time")


if __name__ == "__main__":
    main()
