"""What deep-dive costs: step time with trace_step plus trace_model_instance against untraced,
on a 12-block transformer with steps of about 10 ms on this CPU.

Traced and untraced steps are interleaved in a shuffled order in one process; the untraced
side trains an identical copy of the model that TraceML never saw. Deep-dive measures every
Nth traced step, so the ratio is of mean step times (a median would hide the sampled steps).

    python benchmarks/deep_overhead.py [--steps 300] [--every 10]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import random
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps on each side")
    parser.add_argument("--every", type=int, default=10, help="deep-dive every Nth step")
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()

    import torch
    from torch import nn

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests" / "scripts"))
    from tiny_transformer import TinyTransformer

    import traceml

    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab, batch, seq = 256, 1, 8  # 10-20 ms a step here: op overhead, not FLOPs, dominates
    deep_model = TinyTransformer(vocab, 64, args.blocks, oom_at=10 ** 12)
    plain_model = copy.deepcopy(deep_model)
    traceml.trace_model_instance(deep_model, every_n_steps=args.every)
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
                  for m in (deep_model, plain_model)}
    untraced = lambda model: contextlib.nullcontext()  # noqa: E731

    def one_step(step_context, model) -> int:
        tokens = torch.randint(0, vocab, (batch, seq))
        start = time.perf_counter_ns()
        with step_context(model):
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))
            optimizer = optimizers[id(model)]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return time.perf_counter_ns() - start

    for _ in range(20):  # warm-up: start-up, the collector, the allocator
        one_step(traceml.trace_step, deep_model)
        one_step(untraced, plain_model)
    order = [True] * args.steps + [False] * args.steps
    random.Random(0).shuffle(order)
    times = {True: [], False: []}
    for deep in order:
        times[deep].append(one_step(traceml.trace_step if deep else untraced,
                                     deep_model if deep else plain_model))
    deep_ms, plain_ms = (statistics.fmean(times[side]) / 1e6 for side in (True, False))
    print(f"{args.blocks}-block transformer, {args.steps} steps each side, shuffled; deep-dive every "
          f"{args.every} steps")
    print(f"  untraced step mean:               {plain_ms:8.2f} ms")
    print(f"  traced + deep-dive step mean:     {deep_ms:8.2f} ms")
    print(f"  ratio:                            {deep_ms / plain_ms:8.3f}   target: <= 1.10")


if __name__ == "__main__":
    main()
