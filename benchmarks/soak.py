"""Soak: 1M synthetic steps from 8 ranks through one real collector, and what it costs.

A child process plays 8 ranks over TCP, each sending its 125,000 steps in frames of 500, as
fast as the collector takes them. This process hosts the collector and, while it ingests,
reads the live views every second (the live snapshot both dashboards show, and the web page's
whole-run step series). It prints the collector's peak RSS, the store's bytes per step, the
live views' slowest answer, and how long the end of the run takes once all is in (the
collector's stop, the summary, the card and the run directory's files).

    python benchmarks/soak.py [--ranks 8] [--steps 125000]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

RANKS_SCRIPT = r'''
import socket, sys, time
sys.path[:0] = [sys.argv[4]]
from traceml.records import RankEnd, RankHello, StepRecord
from traceml.wire import encode_frame

port, ranks, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
links = []
for rank in range(ranks):
    link = socket.create_connection(("127.0.0.1", port))
    link.sendall(encode_frame([RankHello(rank, rank, ranks, 0, "soak", 0, "cpu", "cpu", None, "soak",
                                         ["soak"], time.time())]))
    links.append(link)
for first in range(0, steps, 500):
    for rank, link in enumerate(links):
        link.sendall(encode_frame([StepRecord(rank, step, 1.8e9 + step * 0.01, 10.0 + (step % 7) * 0.1,
                                              2.0, 0.3, 0.0, 2.5, 4.0, 0.7, 0.5, 0.0, 0, 1, 32,
                                              host_rss_bytes=(1 << 30) + step)
                                   for step in range(first, min(steps, first + 500))]))
for rank, link in enumerate(links):
    link.sendall(encode_frame([RankEnd(rank, 0, steps, 0)]))
    link.close()
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=125_000, help="steps per rank")
    args = parser.parse_args()
    source_dir = str(Path(__file__).resolve().parent.parent / "src")
    sys.path.insert(0, source_dir)
    from traceml.analysis.goodput import RunTime
    from traceml.analysis.rollup import LiveRollup
    from traceml.collector.server import Collector
    from traceml.collector.store import Store
    from traceml.report.live import snapshot
    from traceml.lifecycle import finish_run
    from traceml.report.run_source import RunSource
    from traceml.report.summary import RunFacts

    me = psutil.Process()
    with tempfile.TemporaryDirectory() as folder:
        store = Store(os.path.join(folder, "telemetry.sqlite"))
        collector = Collector(store, live=LiveRollup(), run_time=RunTime())
        collector.start()
        source = RunSource.of_live_run(Path(folder), store, collector, "soak", time.time())
        rss_start = peak_rss = me.memory_info().rss
        live_ms = []
        started = time.monotonic()
        ranks = subprocess.Popen([sys.executable, "-c", RANKS_SCRIPT, str(collector.port), str(args.ranks),
                                  str(args.steps), source_dir])
        done = threading.Event()

        def watch() -> None:
            nonlocal peak_rss
            while not done.wait(1.0):
                peak_rss = max(peak_rss, me.memory_info().rss)
                began = time.perf_counter()
                snapshot(collector, "soak", time.monotonic() - started, [])
                source.steps(None, None, 1000)
                live_ms.append((time.perf_counter() - began) * 1000)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        ranks.wait()
        collector.wait_for_ranks(timeout_s=600)
        ingest_s = time.monotonic() - started
        done.set()
        watcher.join()
        peak_rss = max(peak_rss, me.memory_info().rss)
        source.close()
        total = args.ranks * args.steps
        stored = store.step_count()
        # The end of the run as `traceml run` does it: the collector stops (rolling what was
        # left), then the summary, the card, final_summary.json and report.html.
        began = time.perf_counter()
        collector.stop()
        facts = RunFacts.from_store(store)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            summary = finish_run(store, Path(folder), facts)
        summary_s = time.perf_counter() - began
        size = sum(path.stat().st_size for path in Path(folder).glob("telemetry.sqlite*"))
        print(f"steps sent {total:,}, stored {stored:,} in {ingest_s:.1f} s ({stored / ingest_s:,.0f} records/s)")
        print(f"collector RSS: {rss_start / 2 ** 20:.0f} MiB at start, {peak_rss / 2 ** 20:.0f} MiB peak")
        print(f"store: {size / 2 ** 20:.0f} MiB, {size / max(1, stored):.0f} bytes a step record")
        print(f"live views (snapshot + whole-run series), {len(live_ms)} reads: median "
              f"{sorted(live_ms)[len(live_ms) // 2] if live_ms else 0:.0f} ms, slowest {max(live_ms, default=0):.0f} ms")
        print(f"end of run (collector stop, summary, card, final_summary.json, report.html): "
              f"{summary_s:.1f} s for {summary['steps']['count']:,} steps x {args.ranks} ranks (target 3 s)")


if __name__ == "__main__":
    main()
