"""What naming the untimed time costs (probe/code_sites.py).

1. Nothing untimed: the sender thread's bookkeeping, per step (note_steps: a few additions) and
   per round (sample() with sampling off: a clock read and a flag), timed with timeit. The
   training thread runs no code of the sampler's at all.
2. Sampling: a training thread runs steps (torch work and Python work, ~4 ms) while a second
   thread calls sample() every 20 ms, as the sender does, with sampling on (the thread is in
   untraced time every round) and off, alternating blocks in one process. Printed: the median
   step with sampling on over the median with it off (each block's ratio, and their median), and
   the sampling thread's CPU time per sample (thread_time around its rounds).

    python benchmarks/untimed_sampler.py [--blocks 8] [--steps 150]
"""
import argparse
import statistics
import sys
import threading
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from traceml.probe.code_sites import SAMPLE_INTERVAL_S, CodeSampler  # noqa: E402
from traceml.records import StepRecord  # noqa: E402


class Probe:
    in_step, open_phase, in_evaluation = 1, -1, False


def clean_step() -> StepRecord:
    return StepRecord(rank=0, step=10, start_unix_s=0.0, step_ms=10.0, input_wait_ms=0.0, outside_ms=0.1, h2d_ms=0.0,
                      forward_ms=4.0, backward_ms=5.0, optimizer_ms=0.8, untraced_ms=0.1, gc_ms=0.0,
                      gc_collections=0, forward_calls=1, samples=8)


def bookkeeping() -> None:
    # The sender drains the steps ended in each 20 ms round: one of a slow loop, 20 of a 1 ms one.
    sampler, probe, steps = CodeSampler(threading.get_ident()), Probe(), [clean_step()] * 20
    number = 20_000
    per_step = min(timeit.repeat(lambda: sampler.note_steps(steps), number=number, repeat=5)) / number / 20 * 1e6
    one = min(timeit.repeat(lambda: sampler.note_steps(steps[:1]), number=number, repeat=5)) / number * 1e6
    per_round = min(timeit.repeat(lambda: sampler.sample(probe), number=number, repeat=5)) / number * 1e6
    assert not sampler.untraced_on and sampler.records(0) == []
    print(f"nothing untimed: note_steps {per_step:.3f} µs a step in rounds of 20 steps, {one:.3f} µs for a "
          f"round of one; sample() {per_round:.3f} µs a round (the sender's thread: the training thread runs none of it)")


def helper(weights: torch.Tensor) -> float:
    """A step's work: torch (the GIL released) and Python (the GIL held)."""
    for _ in range(20):
        weights = torch.tanh(weights @ weights)
    return sum(i * 0.5 for i in range(20_000)) + float(weights[0, 0])


def sampling(blocks: int, steps: int) -> None:
    sampler, probe = CodeSampler(threading.get_ident()), Probe()
    sampler.untraced_on = True
    on, stop, cpu = threading.Event(), threading.Event(), []

    def rounds() -> None:
        while not stop.wait(SAMPLE_INTERVAL_S):
            began = time.thread_time()
            if on.is_set():
                sampler.sample(probe)
                cpu.append(time.thread_time() - began)

    thread = threading.Thread(target=rounds, daemon=True)
    thread.start()
    weights = torch.eye(96) * 0.5
    ratios = []
    for block in range(2 * blocks):
        sampled = block % 2 == 1
        on.set() if sampled else on.clear()
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            helper(weights)
            times.append(time.perf_counter() - began)
        if sampled:
            ratios.append(statistics.median(times) / off_median)
        else:
            off_median = statistics.median(times)
    stop.set()
    thread.join()
    print(f"sampling every {SAMPLE_INTERVAL_S * 1e3:.0f} ms: median step sampled / not sampled "
          f"{statistics.median(ratios):.4f} (blocks {', '.join(f'{r:.3f}' for r in ratios)}); "
          f"sampler CPU {statistics.median(cpu) * 1e6:.0f} µs a sample (median of {len(cpu)}), "
          f"{statistics.median(cpu) / SAMPLE_INTERVAL_S:.2%} of a core")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bookkeeping()
    sampling(args.blocks, args.steps)
