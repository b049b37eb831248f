"""Sender → real TCP socket → collector → real SQLite file, and the faults on that path."""
import json
import socket
import sqlite3
import time

import msgspec
import pytest

from traceml import record_types
from traceml.analysis.goodput import RunTime
from traceml.analysis.rollup import LiveRollup
from traceml.collector.server import Collector
from traceml.collector.store import Store
from traceml.probe.sender import Sender
from traceml.records import RankEnd, RankHello
from traceml.wire import HEADER_BYTES, encode_frame
from test_records import hello, step


@pytest.fixture
def collector(tmp_path):
    store = Store(str(tmp_path / "telemetry.sqlite"))
    collector = Collector(store, live=LiveRollup(), run_time=RunTime())
    collector.start()
    yield collector
    collector.stop()


def wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_records_travel_from_sender_to_the_sqlite_file(collector, tmp_path):
    sender = Sender(hello(), address=collector.address)
    sender.start()
    for index in range(500):
        sender.push(step(index))
    sender.close(exit_code=0)
    assert collector.wait_for_ranks(timeout_s=5)
    collector.stop()
    # A separate connection to the file: WAL mode, committed, every step there.
    with sqlite3.connect(tmp_path / "telemetry.sqlite") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT count(*), min(step), max(step) FROM steps").fetchone() == (500, 0, 499)
        assert db.execute("SELECT forward_ms FROM steps WHERE step = 42").fetchone()[0] == 3.0
    (end,) = collector.store.records(RankEnd)
    assert (end.exit_code, end.records_sent, end.records_dropped) == (0, 500, 0)
    assert collector.store.records(RankHello)[0].pid == 1


class Checkpoint(msgspec.Struct, tag="checkpoint", array_like=True):
    """A record type a later TraceML might add: a column per field, one of them a list."""

    rank: int
    step: int
    path: str
    shard_bytes: list = []


def test_a_new_record_type_is_one_class_and_one_entry_in_the_table(tmp_path, monkeypatch):
    monkeypatch.setitem(record_types.RECORD_TYPES, Checkpoint, record_types.RecordType(
        Checkpoint, "checkpoints", ("rank", "step"), order="step, rank", recent=2, per=("rank",)))
    collector = Collector(Store(str(tmp_path / "telemetry.sqlite")))
    saved = [Checkpoint(rank, step, f"ckpt-{step}", [step, 2 * step]) for step in range(3) for rank in (1, 0)]
    collector.ingest(saved)
    collector.store.close()
    # The store made its table from the entry, and reads the records back in its order.
    stored = Store(str(tmp_path / "telemetry.sqlite"), readonly=True).records(Checkpoint)
    assert stored == sorted(saved, key=lambda record: (record.step, record.rank))
    # The collector keeps each rank's two latest.
    assert collector.kept_by(Checkpoint) == {0: [saved[3], saved[5]], 1: [saved[2], saved[4]]}
    assert collector.latest(Checkpoint) == {0: saved[5], 1: saved[4]}


def test_a_bad_frame_closes_only_its_own_connection(collector):
    good = socket.create_connection(("127.0.0.1", collector.port))
    good.sendall(encode_frame([hello(), step(0)]))
    bad = socket.create_connection(("127.0.0.1", collector.port))
    bad.sendall(b"GET / HTTP/1.1\r\n\r\n")
    bad.settimeout(5)
    assert bad.recv(1) == b""  # closed by the collector
    good.sendall(encode_frame([step(1), step(2)]))
    good.close()
    assert collector.wait_for_ranks(timeout_s=5)
    assert [s.step for s in collector.store.steps()] == [0, 1, 2]
    assert collector.frames_rejected == 1


def test_a_truncated_frame_keeps_what_came_before_it(collector):
    conn = socket.create_connection(("127.0.0.1", collector.port))
    conn.sendall(encode_frame([hello(), step(0)]))
    conn.sendall(encode_frame([step(1)])[: HEADER_BYTES + 3])  # the rank dies mid-frame
    conn.close()
    assert collector.wait_for_ranks(timeout_s=5)
    assert [s.step for s in collector.store.steps()] == [0]


def test_once_the_ranks_have_exited_the_wait_ends_with_what_they_sent(collector):
    # A rank that sent its steps and ended a moment ago: its connection may not be accepted yet.
    conn = socket.create_connection(("127.0.0.1", collector.port))
    conn.sendall(encode_frame([hello(), step(0), step(1)]))
    conn.close()
    assert collector.wait_for_ranks(timeout_s=60, ranks_exited=True)
    assert [s.step for s in collector.store.steps()] == [0, 1]


def test_a_script_that_never_connected_is_not_waited_for_once_it_has_exited(collector):
    started = time.monotonic()
    assert not collector.wait_for_ranks(timeout_s=60, ranks_exited=True)
    assert time.monotonic() - started < 30  # its grace, not the minute a rank still running gets


def test_a_full_buffer_drops_and_counts_and_never_blocks():
    sender = Sender(hello(), capacity=100, address="127.0.0.1:1")  # never started: nothing drains
    started = time.perf_counter()
    for index in range(10_000):
        sender.push(step(index))
    elapsed = time.perf_counter() - started
    assert sender.records_dropped == 9_900
    assert elapsed < 1.0  # 10k pushes; a blocking push would wait forever here


def test_an_unreachable_collector_costs_telemetry_not_time(tmp_path):
    sender = Sender(hello(), address="127.0.0.1:1")
    sender.run_dir = tmp_path  # where a rank that loses its collector keeps its own summary
    sender.start()
    for index in range(50):
        sender.push(step(index))
    started = time.perf_counter()
    sender.close(exit_code=0, timeout_s=3.0)
    assert time.perf_counter() - started < 6.0  # bounded: not the 30 s a blocking connect could take
    assert sender.records_dropped >= 50
    kept = json.loads((tmp_path / "rank0-local-summary.json").read_text())
    assert kept["traceml/steps"] == 50 and kept["reason"] == "the collector was lost during the run"


def test_the_port_is_the_one_the_os_gave(collector):
    assert collector.port > 0
    with socket.create_connection(("127.0.0.1", collector.port)):
        pass
    assert collector.address == f"127.0.0.1:{collector.port}"


def test_collector_binds_loopback_by_default(collector):
    bound = [sock.getsockname()[0] for sock in collector._server.sockets]
    assert bound == ["127.0.0.1"]


def test_end_record_counts_drops_reported_by_the_rank(collector):
    sender = Sender(hello(), capacity=10, address=collector.address)
    for index in range(25):  # before start: 15 of these cannot fit
        sender.push(step(index))
    sender.start()
    sender.close(exit_code=3)
    assert collector.wait_for_ranks(timeout_s=5)
    (end,) = collector.store.records(RankEnd)
    assert end.exit_code == 3 and end.records_dropped == 15
    assert len(collector.store.steps()) == 10


def test_rolled_steps_in_the_store_match_rolling_every_record_again(tmp_path):
    """The collector rolls steps up as they complete; a rank far behind arrives late, and its
    steps are rolled again at the end: the store's rolled steps equal a fresh roll-up."""
    import msgspec

    from traceml.analysis.rollup import roll_up

    store = Store(str(tmp_path / "telemetry.sqlite"))
    collector = Collector(store, live=LiveRollup(), run_time=RunTime())
    collector.live.stale_s = 0.0  # rank 0's steps roll as soon as they are 64 steps behind
    collector.start()
    senders = [Sender(msgspec.structs.replace(hello(), rank=rank, world_size=2), address=collector.address)
               for rank in (0, 1)]
    for sender in senders:
        sender.start()
    for n in range(200):  # rank 0 runs 200 steps ahead: its steps roll stale, without rank 1
        senders[0].push(msgspec.structs.replace(step(n), rank=0, step_ms=10.0 + n % 3))
    assert wait_for(lambda: collector.live.newest_step == 199)
    for n in range(200):
        senders[1].push(msgspec.structs.replace(step(n), rank=1, step_ms=20.0))
    for sender in senders:
        sender.close(exit_code=0)
    assert wait_for(lambda: len(store.records(RankEnd)) == 2)
    collector.stop()
    assert collector.live.late_steps  # rank 1's records came after their steps were rolled
    assert store.meta()["rolled_complete"] is True
    assert store.rolled_steps() == roll_up(store.steps())
    assert all(rolled.ranks == 2 and rolled.worst_rank == 1 for rolled in store.rolled_steps())


def test_one_ranks_rolled_step_is_that_ranks_own_figures():
    """A run of one rank (most runs) rolls each step from that rank's own figures, read at
    once: every median, worst, sum and max of one record is the record's, Nones kept."""
    import msgspec

    from traceml.analysis.rollup import roll_up
    from traceml.records import RolledStep, StepRecord

    fields = msgspec.structs.fields(StepRecord)
    full = StepRecord(*[(index + 3) * 1.5 if "float" in str(field.type) else
                        (index % 2 == 0) if field.type is bool else index + 3 for index, field in enumerate(fields)])
    sparse = msgspec.structs.replace(full, gpu_idle_ms=None, device_allocated_bytes=None, real_tokens=None,
                                     device_peak_bytes=None, device_reserved_bytes=None, host_rss_bytes=None)
    for record in (full, sparse):
        (rolled,) = roll_up([record])
        own = {"ranks": 1, "worst_rank": record.rank, "worst_step_ms": record.step_ms}
        for field in msgspec.structs.fields(RolledStep):
            expected = own[field.name] if field.name in own else getattr(record, field.name)
            assert getattr(rolled, field.name) == expected, field.name


def test_local_steps_sees_every_step_while_a_frame_is_stuck_in_sending(tmp_path):
    """traceml.summary() reads this rank's steps on the training thread at any moment, the
    sender's blocked send included: the steps of the frame in flight are there too, once."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a collector that lags
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sender = Sender(hello(), address=f"127.0.0.1:{listener.getsockname()[1]}")
    sender.run_dir = tmp_path  # where a rank that loses its collector keeps its summary
    sender.start()
    peer, _ = listener.accept()  # and never reads, for now
    try:
        for index in range(20000):  # about 4 MiB of frames: more than the sockets hold
            sender.push(step(index))
        time.sleep(0.5)  # the sender takes a frame's steps and its send gets stuck
        assert sender._buffer and sender.records_sent < 20000
        seen = [record.step for record in sender.local_steps()]
        assert seen == list(range(seen[0], 20000)) and seen[0] <= 20000 - 4096, (seen[0], len(seen))
    finally:
        peer.settimeout(5)
        stop = time.monotonic() + 10
        while sender._thread.is_alive() and time.monotonic() < stop:  # let the sender finish
            try:
                if not peer.recv(1 << 20):
                    break
            except socket.timeout:
                break
            if not sender._buffer and sender.records_sent >= 20000:
                break
        sender.close(exit_code=0, timeout_s=2)
        peer.close()
        listener.close()
    assert sender.records_sent >= 20000


def test_the_sampler_sees_the_training_wait_for_a_cpu(tmp_path):
    """More busy training processes than cores: between them they wait, ready, for a CPU at
    least as long as the cores they lack, which the sampler reads from Linux's schedstat."""
    import os
    import subprocess
    import sys

    from traceml.collector.system import SystemSampler

    if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
        pytest.skip("no schedstat: Linux's scheduler statistics are off")
    cores = len(os.sched_getaffinity(0))
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(cores + 2)]
    try:
        sampler = SystemSampler(lambda samples: None, lambda: [p.pid for p in busy])
        assert sampler.sample().training_cpu_wait_percent is None  # the first sample starts the count
        time.sleep(1.5)
        sample = sampler.sample()
        # cores + 2 spinning on `cores` cores: 2 cores' worth of them wait at any moment, or more
        # on a machine busy with anything else. Half of that leaves room for the sampler's own
        # reading times.
        assert sample.training_cpu_wait_percent >= 100.0, sample
        assert sample.training_cpu_percent <= 100.0 * cores + 10.0
    finally:
        for process in busy:
            process.kill()
            process.wait()
