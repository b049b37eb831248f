"""Web dashboard at scale: a store of 1M steps (by default), served by the real app over HTTP.

Every step also has a user span and a scalar, as under the Trace API. Prints, per endpoint, the response time of the first request (cold: the whole run is read
once) and of a refresh (warm: only the newest buckets are read again), the points in the
largest series and the bytes sent. Then appends steps, as a live run would, and times the
refresh that follows.

    python benchmarks/web_scale.py [--steps 1000000] [--ranks 1]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path

from traceml.collector.store import Store
from traceml.records import RankHello, ScalarRecord, SpanRecord, StepRecord
from traceml.report.run_source import RunSource
from traceml.views.web.app import WebServer

ENDPOINTS = ["/api/overview", "/api/steps", "/api/steps?start=500000&end=501000", "/api/ranks",
             "/api/timeline?steps=50", "/api/system", "/api/spans", "/api/scalars", "/api/layers"]


def fill(store: Store, ranks: int, first: int, last: int) -> None:
    """Steps, and on rank 0 a user span and a logged scalar each step (the Trace API's rows)."""
    rng = random.Random(first)
    for begin in range(first, last, 20000):
        steps = range(begin, min(last, begin + 20000))
        store.write([StepRecord(rank, step, 1.8e9 + step * 0.01, 10.0 + rng.random(), 1.0, 0.5, 0.0,
                                3.0, 4.0, 1.0, 0.5, 0.0, 0, 1, 32, host_rss_bytes=2 ** 30 + step)
                     for step in steps for rank in range(ranks)])
        store.write([SpanRecord(0, step, "forward_pass", 1.8e9 + step * 0.01, 3.1, 1) for step in steps])
        store.write([ScalarRecord(0, step, "train_loss", 1.0 / (1 + step)) for step in steps])
        store.commit()


def fetch(url: str) -> tuple:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as response:
        body = response.read()
    elapsed_ms = (time.perf_counter() - started) * 1000
    return elapsed_ms, body


def longest_series(value: object) -> int:
    if isinstance(value, list):
        return max([len(value)] + [longest_series(item) for item in value])
    if isinstance(value, dict):
        return max([0] + [longest_series(item) for item in value.values()])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder)
        store = Store(str(run_dir / "telemetry.sqlite"))
        store.write([RankHello(rank, rank, args.ranks, 0, "host", 1, "cpu", "cpu", None, "2", ["bench"], 0.0)
                     for rank in range(args.ranks)])
        started = time.perf_counter()
        fill(store, args.ranks, 0, args.steps)
        print(f"store: {args.steps:,} steps x {args.ranks} rank(s) written in "
              f"{time.perf_counter() - started:.1f} s, "
              f"{(run_dir / 'telemetry.sqlite').stat().st_size / 2 ** 20:.0f} MiB")
        store.set_meta({})
        summary = {"run": {"script": "bench", "duration_s": 0.0}, "steps": {"count": args.steps},
                   "phases": {}, "findings": [], "ranks": [], "rank_spread": {}}
        (run_dir / "final_summary.json").write_text(json.dumps(summary))
        source = RunSource.of_finished_run(run_dir)
        web = WebServer(source, "127.0.0.1", 0)
        web.start()
        try:
            print(f"{'endpoint':40s} {'cold ms':>9s} {'warm ms':>9s} {'points':>7s} {'KiB':>7s}")
            for path in ENDPOINTS:
                cold_ms, body = fetch(web.url.rstrip("/") + path)
                warm_ms, body = fetch(web.url.rstrip("/") + path)
                points = longest_series(json.loads(body))
                print(f"{path:40s} {cold_ms:9.0f} {warm_ms:9.1f} {points:7d} {len(body) / 1024:7.0f}")
            fill(store, args.ranks, args.steps, args.steps + 2000)  # the run goes on
            refresh_ms, _ = fetch(web.url + "api/steps")
            print(f"refresh after 2,000 more steps: /api/steps {refresh_ms:.0f} ms")
        finally:
            web.stop()
            store.close()


if __name__ == "__main__":
    main()
