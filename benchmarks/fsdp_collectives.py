"""What timing FSDP's collectives adds: a wrapped torch.distributed collective against the
original, called in turn in one process (a one-rank gloo group, a 64-element all-reduce), inside
a forward phase as FSDP calls them. Prints each one's median per call and the difference, and
what that is for a step with --collectives of them (a 4-block model under fully_shard makes 14:
5 all-gathers in forward, 4 re-gathers and 5 reduce-scatters in backward).

Besides this, a step under FSDP is timed by the Python path, not the C timers (the collective
wait is one of the figures only Python keeps): `benchmarks/overhead.py --only calls` gives that
difference, about 20 µs a step on this project's VM.

    python benchmarks/fsdp_collectives.py [--rounds 200] [--calls 200] [--collectives 14]
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import types

import torch
import torch.distributed as dist

from traceml.probe import layout
from traceml.probe import sharded
from traceml.probe.step_state import FORWARD
from traceml.probe.step import StepProbe


def per_call_us(collective, tensor, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        collective(tensor)
    return (time.perf_counter_ns() - start) / calls / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--collectives", type=int, default=14)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    # The probe's side of it: the phase read and the sum added to, as StepProbe does them.
    probe = types.SimpleNamespace(open_phase=FORWARD, sums=[0] * len(layout.STEP_SLOTS), step_index=0)
    probe.comm_waited = functools.partial(StepProbe.comm_waited, probe)
    not_compiling = types.SimpleNamespace(_is_compiling_flag=False)
    sharded._wrapping.timed = True  # a model on the host: its collectives are timed
    original = dist.all_reduce
    wrapped = sharded._wrapped(probe, original, not_compiling, gathers=False)
    tensor = torch.ones(64)
    plain, timed = [], []
    for _ in range(args.rounds):  # in turn, so drift and noise fall on both alike
        plain.append(per_call_us(original, tensor, args.calls))
        timed.append(per_call_us(wrapped, tensor, args.calls))
    plain_us, timed_us = statistics.median(plain), statistics.median(timed)
    added_us = statistics.median(t - p for t, p in zip(timed, plain))
    print(f"all_reduce of 64 floats, one-rank gloo, {args.rounds} rounds of {args.calls} calls each way")
    print(f"original  median {plain_us:.2f} µs a call")
    print(f"timed     median {timed_us:.2f} µs a call")
    print(f"added     median {added_us:+.2f} µs a call; {added_us * args.collectives:+.1f} µs a step "
          f"of {args.collectives} collectives")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
