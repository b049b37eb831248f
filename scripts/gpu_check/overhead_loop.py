"""GPU check: what TraceML adds to a ~10 ms GPU step (a small transformer under bf16 autocast),
traced against untraced blocks interleaved in one process; prints one JSON line.

As in benchmarks/overhead.py: TraceML is attached for a traced block and detached (torch as it
was) for an untraced one, in a shuffled order, so the machine's drift hits both sides alike; the
first step after each switch is not counted. A block is timed on the wall clock between two
synchronizes made by this script (never by TraceML): with the device saturated, that is the
device's time for the block, so work TraceML adds on the host shows only where it delays the
device. The batch is sized at start so that an untraced step takes about --target-ms.
"""
import argparse
import contextlib
import json
import random
import statistics
import time

import torch
from torch import nn

import traceml
from traceml.probe import process as probe_process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target-ms", type=float, default=10.0, help="untraced step time to size the batch for")
    parser.add_argument("--blocks", type=int, default=16, help="blocks on each side")
    parser.add_argument("--block-steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()

    torch.manual_seed(0)
    on_cuda = args.device.startswith("cuda")
    layer = nn.TransformerEncoderLayer(args.width, nhead=max(1, args.width // 64), dim_feedforward=4 * args.width,
                                       dropout=0.0, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_cuda or None)
    inputs = torch.randn(1, args.seq, args.width, device=args.device)

    def wait():
        if on_cuda:
            torch.cuda.synchronize()

    def one_step(traced):
        with traceml.trace_step(model) if traced else contextlib.nullcontext():
            with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16):
                outputs = model(inputs)
            loss = outputs.float().pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def block_ms(traced, steps):
        wait()
        start = time.perf_counter()
        for _ in range(steps):
            one_step(traced)
        wait()
        return (time.perf_counter() - start) * 1e3 / steps

    # Size the batch, untraced: double it until a step takes the target (a smaller step may be
    # bound by kernel launches on the host, not by the device), then scale it down to the target.
    batch = 1
    while True:
        inputs = torch.randn(batch, args.seq, args.width, device=args.device)
        one_step(False)
        measured_ms = block_ms(False, 3)
        if measured_ms >= args.target_ms or batch >= 1024:
            break
        batch *= 2
    batch = max(1, round(batch * args.target_ms / measured_ms))
    inputs = torch.randn(batch, args.seq, args.width, device=args.device)
    for traced in (False, True) * 5:  # warm-up at the real size, both sides, the collector up
        one_step(traced)

    order = [True] * args.blocks + [False] * args.blocks
    random.Random(0).shuffle(order)
    step_ms = {True: [], False: []}
    for traced in order:
        if traced:
            with traceml.trace_step(model):  # attaches again after a detach
                pass
        else:
            probe_process.detach()
        one_step(traced)  # refills what the switch emptied: not counted
        step_ms[traced].append(block_ms(traced, args.block_steps))
    with traceml.trace_step(model):
        pass
    traced_ms, untraced_ms = statistics.median(step_ms[True]), statistics.median(step_ms[False])
    print(json.dumps({"batch": batch, "seq": args.seq, "width": args.width, "layers": args.layers,
                      "traced_step_ms": traced_ms, "untraced_step_ms": untraced_ms,
                      "added_pct": (traced_ms - untraced_ms) / untraced_ms * 100.0,
                      "traced_blocks_ms": step_ms[True], "untraced_blocks_ms": step_ms[False]}), flush=True)


if __name__ == "__main__":
    main()
