"""The wire under attack: a property-based test of the decoder, timeouts for idle and slow
peers, and 10,000 random and mutated frames at a live collector while real ranks send."""
import random
import socket
import struct
import threading
import time

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from traceml.analysis.goodput import RunTime
from traceml.analysis.rollup import LiveRollup
from traceml.collector.server import Collector
from traceml.collector.store import Store
from traceml.probe.sender import Sender
from traceml.records import RankEnd, RankHello, StepRecord
from traceml.wire import HEADER_BYTES, MAX_FRAME_BYTES, WIRE_VERSION, FrameError, decode_payload, encode_frame, parse_header
from test_collector import wait_for
from test_records import hello, step

TOKEN = "fuzz-s3cret"


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_the_decoder_takes_any_bytes_and_only_ever_raises_frame_error(payload):
    try:
        records = decode_payload(payload)
    except FrameError:
        return
    assert isinstance(records, list)
    assert all(isinstance(record, msgspec.Struct) for record in records)


VALID_PAYLOAD = encode_frame([hello(), step(1), step(2)])[HEADER_BYTES:]


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID_PAYLOAD) - 1), st.integers(0, 255)), min_size=1,
                max_size=6), st.integers(1, len(VALID_PAYLOAD)))
def test_a_mutated_valid_payload_decodes_or_is_refused(flips, keep):
    payload = bytearray(VALID_PAYLOAD[:keep])
    for position, value in flips:
        if position < len(payload):
            payload[position] = value
    try:
        records = decode_payload(bytes(payload))
    except FrameError:
        return
    assert isinstance(records, list)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES))
def test_any_header_is_a_length_within_bounds_or_refused(header):
    try:
        length = parse_header(header)
    except FrameError:
        return
    assert 0 <= length <= MAX_FRAME_BYTES and header[:2] == b"TM" and header[2] == WIRE_VERSION


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.builds(StepRecord, rank=st.integers(0, 4096), step=st.integers(0, 2 ** 40),
                          start_unix_s=finite, step_ms=finite, input_wait_ms=finite, outside_ms=finite,
                          h2d_ms=finite, forward_ms=finite, backward_ms=finite, optimizer_ms=finite,
                          untraced_ms=finite, gc_ms=finite, gc_collections=st.integers(0, 10 ** 6),
                          forward_calls=st.integers(0, 10 ** 6), samples=st.integers(0, 2 ** 31),
                          host_rss_bytes=st.none() | st.integers(0, 2 ** 50),
                          real_tokens=st.none() | st.integers(0, 2 ** 40)), max_size=20))
def test_every_step_record_survives_the_wire(records):
    frame = encode_frame(records)
    assert decode_payload(frame[HEADER_BYTES:HEADER_BYTES + parse_header(frame[:HEADER_BYTES])]) == records


@pytest.fixture
def collector(tmp_path):
    store = Store(str(tmp_path / "telemetry.sqlite"))
    collector = Collector(store, token=TOKEN, hello_timeout_s=0.5, frame_timeout_s=0.5, idle_timeout_s=2.0,
                          live=LiveRollup(), run_time=RunTime())
    collector.start()
    yield collector
    collector.stop()


def closed_by_peer(sock, timeout_s=5.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_idle_and_slow_peers_are_dropped_and_the_collector_goes_on(collector):
    host, port = collector.address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    assert closed_by_peer(silent)  # no hello within the hello timeout
    slow = socket.create_connection((host, int(port)))
    slow.sendall(struct.pack(">2sBxI", b"TM", WIRE_VERSION, 1000) + b"x" * 10)  # then nothing
    assert closed_by_peer(slow)
    greeted = socket.create_connection((host, int(port)))
    greeted.sendall(encode_frame([msgspec.structs.replace(hello(), token=TOKEN)]))
    assert closed_by_peer(greeted)  # greeted, then idle past the idle timeout
    assert collector.frames_rejected >= 3
    sender = Sender(msgspec.structs.replace(hello(), rank=0, token=TOKEN), address=collector.address)
    sender.start()
    for index in range(20):
        sender.push(step(index))
    sender.close(exit_code=0)
    assert wait_for(lambda: collector.store.step_count() == 20, timeout_s=10)


def mutated_frames(rng: random.Random, valid: list):
    """Random bytes, and valid frames broken in every way a frame can be."""
    while True:
        kind = rng.randrange(7)
        frame = bytearray(rng.choice(valid))
        if kind == 0:
            yield bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
        elif kind == 1:  # flipped bytes anywhere
            for _ in range(rng.randrange(1, 8)):
                frame[rng.randrange(len(frame))] = rng.getrandbits(8)
            yield bytes(frame)
        elif kind == 2:  # truncated
            yield bytes(frame[:rng.randrange(1, len(frame))])
        elif kind == 3:  # a wrong version
            frame[2] = (WIRE_VERSION + rng.randrange(1, 255)) % 256
            yield bytes(frame)
        elif kind == 4:  # a header announcing more than the maximum
            yield struct.pack(">2sBxI", b"TM", WIRE_VERSION, MAX_FRAME_BYTES + rng.randrange(1, 2 ** 20))
        elif kind == 5:  # a well-formed frame of garbage
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200)))
            yield struct.pack(">2sBxI", b"TM", WIRE_VERSION, len(payload)) + payload
        else:  # steps with no hello, or a hello with the wrong token
            yield bytes(frame)


@pytest.fixture
def patient_collector(tmp_path):
    """Default idle timeout: real ranks stay connected however long the attack takes."""
    collector = Collector(Store(str(tmp_path / "telemetry.sqlite")), token=TOKEN, hello_timeout_s=0.5,
                          frame_timeout_s=0.5, live=LiveRollup(), run_time=RunTime())
    collector.start()
    yield collector
    collector.stop()


def test_ten_thousand_bad_frames_do_not_cost_the_real_ranks_a_record(patient_collector):
    collector = patient_collector
    host, port = collector.address.rsplit(":", 1)
    steps_per_rank = 400
    senders = [Sender(msgspec.structs.replace(hello(), rank=rank, world_size=2, token=TOKEN),
                      address=collector.address) for rank in (0, 1)]
    for sender in senders:
        sender.start()
    valid = [encode_frame([step(n) for n in range(3)]), encode_frame([hello()]),
             encode_frame([msgspec.structs.replace(hello(), token="wrong"), step(1)])]
    sent = [0]

    def attack():
        rng = random.Random(1234)
        frames = mutated_frames(rng, valid)
        while sent[0] < 10_000:
            with socket.create_connection((host, int(port))) as sock:
                sock.settimeout(2.0)
                try:  # several frames a connection: the first bad one ends it
                    for _ in range(5):
                        sock.sendall(next(frames))
                        sent[0] += 1
                except OSError:
                    pass

    attacker = threading.Thread(target=attack)
    attacker.start()
    for index in range(steps_per_rank):
        for rank, sender in enumerate(senders):
            sender.push(msgspec.structs.replace(step(index), rank=rank))
        if index % 50 == 0:
            time.sleep(0.05)
    attacker.join(timeout=300)
    assert sent[0] >= 10_000
    for sender in senders:
        sender.close(exit_code=0)
    assert sum(sender.records_dropped for sender in senders) == 0
    assert wait_for(lambda: len(collector.store.records(RankEnd)) == 2, timeout_s=10)  # both goodbyes: all is in
    rows = [(rank, collector.store.step_count(rank), *collector.store.step_bounds("steps", rank)) for rank in (0, 1)]
    assert rows == [(0, steps_per_rank, 0, steps_per_rank - 1), (1, steps_per_rank, 0, steps_per_rank - 1)]
    assert collector.store.step_count() == 2 * steps_per_rank  # nothing forged
    assert collector.frames_rejected >= 1000
    assert {h.rank for h in collector.store.records(RankHello)} == {0, 1}
