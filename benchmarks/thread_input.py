"""What TraceML's timing of a prefetching thread's input costs per call: the training thread's
queue.Queue.get (timed as its input wait), another thread's get (passed through), and a
DataLoader's next() on another thread (its time added up for INPUT_BOUND's advice).

Each operation runs in rounds with TraceML attached and detached in turn, in one process; a
round's figure is the calling thread's CPU time per call (time.thread_time, which a busy machine
moves far less than the wall clock), and each side's is the least of its rounds.

    python benchmarks/thread_input.py [--calls 20000] [--rounds 15]
"""
from __future__ import annotations

import argparse
import os
import queue
import tempfile
import threading
import time
import timeit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds on each side, per operation")
    args = parser.parse_args()
    os.environ.setdefault("TRACEML_RUN_DIR", tempfile.mkdtemp(prefix="traceml-thread-input-"))

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import traceml
    from traceml.probe import process as probe_process

    torch.set_num_threads(1)
    model = nn.Linear(4, 2)
    buffer: queue.Queue = queue.Queue()
    data = TensorDataset(torch.randn(8 * (args.calls + 1) * args.rounds * 2, 4))

    def put_and_get() -> None:
        buffer.put(None)
        buffer.get()

    def attach(attached: bool) -> None:
        if attached:
            with traceml.trace_step(model):
                model(torch.zeros(1, 4))
        else:
            probe_process.detach()

    def per_call_us(operation, on_thread: bool) -> float:
        timed = []

        def run() -> None:
            timed.append(timeit.timeit(operation, number=args.calls, timer=time.thread_time) / args.calls * 1e6)

        if on_thread:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        else:
            run()
        return timed[0]

    attach(True)
    batches = iter(DataLoader(data, batch_size=8))  # a training iterator, noted: iterated on a thread below
    operations = {"queue put + get, training thread": (put_and_get, False),
                  "queue put + get, another thread": (put_and_get, True),
                  "DataLoader next, another thread": (lambda: next(batches), True)}
    print(f"{args.rounds} rounds of {args.calls} calls on each side; µs of the thread's CPU per call (least of rounds)")
    print(f"  {'operation':34s} {'detached':>9s} {'attached':>9s} {'added':>8s}")
    for name, (operation, on_thread) in operations.items():
        per_call = {True: [], False: []}
        for _ in range(args.rounds):
            for attached in (True, False):
                attach(attached)
                per_call[attached].append(per_call_us(operation, on_thread))
        detached, attached_us = min(per_call[False]), min(per_call[True])
        print(f"  {name:34s} {detached:9.2f} {attached_us:9.2f} {attached_us - detached:+8.2f}")
    attach(True)


if __name__ == "__main__":
    main()
