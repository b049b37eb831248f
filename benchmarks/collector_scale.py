"""How much one collector takes: 256 simulated ranks stream step records at a real collector.

A child process plays the ranks: 256 TCP connections, each sending a hello, then every
100 ms (as the probe's sender does) a frame with the steps it finished since. Frames are
encoded before the clock starts, so the figures are the collector's: records ingested per
second (decoded, stored in SQLite, rolled up live), the lag from the moment the last rank sent
a step to the moment that step was rolled up across all ranks, and the collector's RSS.

    python benchmarks/collector_scale.py [--ranks 256] [--steps-per-s 400] [--seconds 10]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading

RANKS_SCRIPT = r'''
import json, socket, sys, time
sys.path[:0] = [sys.argv[5]]
from traceml.records import RankHello, StepRecord
from traceml.wire import encode_frame

port, ranks, steps_per_s, seconds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
per_frame = max(1, steps_per_s // 10)  # one frame every 100 ms
frames_per_rank = int(seconds * 10)

def record(rank, step):
    return StepRecord(rank=rank, step=step, start_unix_s=0.0, step_ms=2.5, input_wait_ms=0.2,
                      outside_ms=0.1, h2d_ms=0.0, forward_ms=0.8, backward_ms=1.1, optimizer_ms=0.2,
                      untraced_ms=0.1, gc_ms=0.0, gc_collections=0, forward_calls=1, samples=8,
                      host_rss_bytes=1 << 30)

frames = [[encode_frame([record(rank, f * per_frame + i) for i in range(per_frame)])
           for rank in range(ranks)] for f in range(frames_per_rank)]
sockets = []
for rank in range(ranks):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(encode_frame([RankHello(rank=rank, local_rank=rank % 8, world_size=ranks, node_rank=rank // 8,
                                         host="sim", pid=0, device="cpu", device_name="cpu",
                                         device_capacity_bytes=None, torch_version="sim", argv=["sim"],
                                         started_at_unix_s=time.time())]))
    sockets.append(sock)
sent_at = []  # (last step in the frame round, monotonic time the last rank sent it)
start = time.monotonic()
for f, round_frames in enumerate(frames):
    target = start + f * 0.1
    delay = target - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    for sock, frame in zip(sockets, round_frames):
        sock.sendall(frame)
    sent_at.append(((f + 1) * per_frame - 1, time.monotonic()))
elapsed = time.monotonic() - start
for sock in sockets:
    sock.close()
print(json.dumps({"sent_at": sent_at, "started": start, "elapsed_s": elapsed,
                  "records": ranks * per_frame * frames_per_rank}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps-per-s", type=int, default=400, help="per rank")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    import psutil

    from traceml.analysis.goodput import RunTime
    from traceml.analysis.rollup import LiveRollup
    from traceml.collector.server import Collector
    from traceml.collector.store import Store

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    with tempfile.TemporaryDirectory() as workdir:
        collector = Collector(Store(os.path.join(workdir, "telemetry.sqlite")), live=LiveRollup(), run_time=RunTime())
        # Keep every rolled step's time for the lag figures (a live view keeps the last 4096).
        collector.live = LiveRollup(keep_steps=1_000_000)
        collector.start()
        me = psutil.Process()
        rss_samples = []
        stop = threading.Event()

        def sample_rss() -> None:
            while not stop.wait(0.25):
                rss_samples.append(me.memory_info().rss)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        rss_before = me.memory_info().rss
        out = subprocess.run([sys.executable, "-c", RANKS_SCRIPT, str(collector.port), str(args.ranks),
                              str(args.steps_per_s), str(args.seconds), src],
                             capture_output=True, text=True, check=True).stdout
        ranks = json.loads(out)
        collector.wait_for_ranks(timeout_s=60)
        # Monotonic clocks are one clock across processes here: from the first frame sent to
        # the last step rolled up.
        ingest_s = max(collector.live.rolled_at) - ranks["started"]
        stop.set()
        sampler.join()
        rolled = dict(zip((s.step for s in collector.live.recent), collector.live.rolled_at))
        lags = [rolled[step] - sent for step, sent in ranks["sent_at"] if step in rolled]
        collector.stop()
        db_bytes = os.path.getsize(os.path.join(workdir, "telemetry.sqlite"))

    records = ranks["records"]
    print(f"{args.ranks} ranks x {args.steps_per_s} steps/s for {args.seconds:.0f} s: "
          f"{records:,} step records")
    print(f"  offered:   {records / ranks['elapsed_s']:>10,.0f} records/s "
          "(a collector that keeps up ingests as fast, with a flat lag)")
    print(f"  ingested:  {collector.records_ingested - args.ranks:>10,} records "
          f"in {ingest_s:.2f} s: {records / ingest_s:,.0f} records/s   target: >= 100,000 /s")
    if lags:
        lags.sort()
        print(f"  lag, send to rollup: median {statistics.median(lags) * 1000:.0f} ms, "
              f"p99 {lags[math.ceil(0.99 * len(lags)) - 1] * 1000:.0f} ms, max {lags[-1] * 1000:.0f} ms"
              f"   target: < 1 s")
    print(f"  collector RSS: {rss_before / 2**20:.0f} MiB before, peak "
          f"{max(rss_samples + [rss_before]) / 2**20:.0f} MiB, last {rss_samples[-1] / 2**20:.0f} MiB; "
          f"store {db_bytes / records:.0f} bytes/record")


if __name__ == "__main__":
    main()
