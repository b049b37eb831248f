"""What deep-dive costs: step time with trace_step plus trace_model_instance against untraced,
on a 12-block transformer with steps of about 10 ms on this CPU; and what automatic capture
costs a run in which no rule fires.

Traced and untraced steps are interleaved in a shuffled order in one process; the untraced
side trains an identical copy of the model that TraceML never saw. Deep-dive measures every
Nth traced step, so the ratio is of mean step times (a median would hide the sampled steps).
With --capture, the traced side is trace_step alone, run twice (each in a process of its own,
each against its own untraced side): automatic capture on (its two sampled steps before, its
rules watching every step) and off; the difference of the two ratios is what it adds.

    python benchmarks/deep_overhead.py [--steps 300] [--every 10] [--capture]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import statistics
import sys
import tempfile
import time


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps on each side")
    parser.add_argument("--every", type=int, default=10, help="deep-dive every Nth step")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--capture", action="store_true",
                        help="trace_step alone, automatic capture on and off")
    parser.add_argument("--trace-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(tempfile.mkdtemp(prefix="traceml-bench-"))  # the run this makes goes there
    if args.capture:
        compare_capture(args)
        return

    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from tiny_transformer import TinyTransformer

    import traceml

    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab, batch, seq = 256, 1, 8  # 10-20 ms a step here: op overhead, not FLOPs, dominates
    deep_model = TinyTransformer(vocab, 64, args.blocks, oom_at=10 ** 12)
    plain_model = copy.deepcopy(deep_model)
    if not args.trace_only:
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
    if args.trace_only:
        from traceml.probe import step as probe_step

        layers = probe_step._probe.layers
        print(f"{deep_ms / plain_ms:.4f} {deep_ms:.3f} {plain_ms:.3f} {layers.captures_taken if layers else 0} "
              f"{bookkeeping_us(layers) if layers else 0.0:.3f}")
        return
    print(f"{args.blocks}-block transformer, {args.steps} steps each side, shuffled; deep-dive every "
          f"{args.every} steps")
    print(f"  untraced step mean:               {plain_ms:8.2f} ms")
    print(f"  traced + deep-dive step mean:     {deep_ms:8.2f} ms")
    print(f"  ratio:                            {deep_ms / plain_ms:8.3f}   target: <= 1.10")


def compare_capture(args: argparse.Namespace) -> None:
    import subprocess

    ratios = {}
    for setting in ("1", "0"):
        env = dict(os.environ, TRACEML_AUTO_CAPTURE=setting)
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "deep_overhead.py"), "--trace-only", "--steps", str(args.steps),
                              "--blocks", str(args.blocks)], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        ratios[setting] = [float(value) for value in out[:5]]
    print(f"{args.blocks}-block transformer, {args.steps} steps each side, shuffled; trace_step alone "
          "(captures: how many times a rule fired on this machine's own jitter)")
    for setting, label in (("1", "automatic capture on "), ("0", "automatic capture off")):
        ratio, traced_ms, plain_ms, captures, _ = ratios[setting]
        print(f"  {label}: traced {traced_ms:7.2f} ms vs untraced {plain_ms:7.2f} ms   ratio {ratio:.3f}"
              f"   captures {captures:.0f}")
    print(f"  ratio on minus off: {ratios['1'][0] - ratios['0'][0]:+.3f} (processes differ by a few % on "
          "this machine; a capture costs what 3 deep-dive steps cost)")
    on_ms = ratios["1"][1]
    print(f"  when no rule fires, capture's bookkeeping costs {ratios['1'][4]:.2f} µs a step "
          f"({ratios['1'][4] / (on_ms * 1e3):.4%} of a step), plus its 2 sampled steps before, once a run")


def bookkeeping_us(layers) -> float:
    """Per step, what capture costs when nothing fires: the layer probe's begin and end of an
    unsampled step, and the rules looking at one closed step (the latter on the sender's thread)."""
    from traceml.probe.layers import AnomalyWatch
    from traceml.records import StepRecord

    record = StepRecord(rank=0, step=0, start_unix_s=0.0, step_ms=10.0, input_wait_ms=0.0, outside_ms=0.0,
                        h2d_ms=0.0, forward_ms=3.0, backward_ms=6.0, optimizer_ms=1.0, untraced_ms=0.0,
                        gc_ms=0.0, gc_collections=0, forward_calls=1, samples=1, host_rss_bytes=2 ** 30)
    watch = AnomalyWatch()
    rounds = 20000
    start = time.perf_counter_ns()
    for index in range(10 ** 6, 10 ** 6 + rounds):
        layers.begin_step(index)
        layers.end_step()
        record.step = index
        watch.observe(record)
    return (time.perf_counter_ns() - start) / rounds / 1e3


if __name__ == "__main__":
    main()
