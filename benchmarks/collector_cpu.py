"""The collector's CPU per step of one rank: what a run of sub-millisecond steps costs beside it.

The frames a 40,000-step run of 250 µs steps would send (80 steps a frame, every 20 ms of
steps; with --trace-api a span and a scalar each step too) are encoded first; the clock
(`time.process_time`, this process's CPU) then times what the collector does with them: decode
each frame, store it in a real SQLite file, roll the steps up, tally the run's time, and commit
every 2000 steps (every 0.5 s of such a run, as the collector commits). Printed per step, the
median of --rounds runs, each with a fresh store.

    python benchmarks/collector_cpu.py [--steps 40000] [--rounds 3] [--trace-api]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from traceml.analysis.goodput import RunTime
from traceml.analysis.rollup import LiveRollup
from traceml.collector.server import Collector
from traceml.collector.store import Store
from traceml.records import ScalarRecord, SpanRecord, StepRecord
from traceml.wire import HEADER_BYTES, decode_payload, encode_frame

STEPS_PER_FRAME = 80
COMMIT_EVERY_STEPS = 2000
STEP_S = 0.00025


def run_frames(steps: int, trace_api: bool) -> list:
    started_s = time.time()
    frames = []
    for first in range(0, steps, STEPS_PER_FRAME):
        records: list = []
        for step in range(first, min(steps, first + STEPS_PER_FRAME)):
            start_s = started_s + step * STEP_S
            records.append(StepRecord(0, step, start_s, 0.25, 0.01, 0.01, 0.0, 0.08, 0.1, 0.03, 0.01, 0.0, 0, 1, 8,
                                      host_rss_bytes=300 << 20))
            if trace_api:
                records.append(SpanRecord(0, step, "forward", start_s, 0.08, 1))
                records.append(ScalarRecord(0, step, "loss", 2.3 - step * 1e-5))
        frames.append(encode_frame(records))
    return frames


def cpu_per_step_us(frames: list, steps: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        store = Store(os.path.join(folder, "telemetry.sqlite"))
        collector = Collector(store, live=LiveRollup(), run_time=RunTime())
        started = time.process_time()
        ingested = 0
        for frame in frames:
            records = decode_payload(frame[HEADER_BYTES:])
            collector.ingest(records)
            ingested += STEPS_PER_FRAME
            if ingested % COMMIT_EVERY_STEPS == 0:
                store.commit()
        store.commit()
        used_s = time.process_time() - started
        store.close()
    return used_s * 1e6 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace-api", action="store_true", help="a span and a scalar each step too")
    args = parser.parse_args()
    frames = run_frames(args.steps, args.trace_api)
    figures = [cpu_per_step_us(frames, args.steps) for _ in range(args.rounds)]
    what = "steps, a span and a scalar" if args.trace_api else "steps"
    print(f"collector CPU per step, one rank ({what}; {args.steps} steps, {args.rounds} rounds): "
          f"{statistics.median(figures):.1f} µs  [{min(figures):.1f}, {max(figures):.1f}]")


if __name__ == "__main__":
    main()
