"""The wire: frames round-trip, and every kind of bad frame is refused with a FrameError."""
import struct

import msgspec
import pytest

from traceml.records import RankEnd, RankHello, StepRecord
from traceml.wire import HEADER_BYTES, MAX_FRAME_BYTES, WIRE_VERSION, FrameError, decode_payload, encode_frame, parse_header


def step(n: int) -> StepRecord:
    return StepRecord(rank=0, step=n, start_unix_s=1.0 + n, step_ms=10.0, input_wait_ms=1.0,
                      outside_ms=1.0, h2d_ms=0.0, forward_ms=3.0, backward_ms=3.0, optimizer_ms=1.5,
                      untraced_ms=0.5, gc_ms=0.0, gc_collections=0, forward_calls=1, samples=8,
                      host_rss_bytes=123)


def hello() -> RankHello:
    return RankHello(rank=0, local_rank=0, world_size=1, node_rank=0, host="h", pid=1, device="cpu",
                     device_name="cpu", device_capacity_bytes=None, torch_version="2.13.0",
                     argv=["train.py"], started_at_unix_s=1.0)


def test_frame_round_trip_keeps_every_record_and_type():
    records = [hello(), step(0), step(1), RankEnd(rank=0, exit_code=0, records_sent=3, records_dropped=2)]
    frame = encode_frame(records)
    length = parse_header(frame[:HEADER_BYTES])
    assert length == len(frame) - HEADER_BYTES
    decoded = decode_payload(frame[HEADER_BYTES:])
    assert decoded == records
    assert [type(r) for r in decoded] == [RankHello, StepRecord, StepRecord, RankEnd]


def test_wrong_magic_is_refused():
    frame = bytearray(encode_frame([step(0)]))
    frame[0:2] = b"XX"
    with pytest.raises(FrameError, match="magic"):
        parse_header(bytes(frame[:HEADER_BYTES]))


def test_wrong_version_is_refused():
    frame = bytearray(encode_frame([step(0)]))
    frame[2] = WIRE_VERSION + 1
    with pytest.raises(FrameError, match="version"):
        parse_header(bytes(frame[:HEADER_BYTES]))


def test_oversized_frame_is_refused_from_its_header():
    header = struct.pack(">2sBxI", b"TM", WIRE_VERSION, MAX_FRAME_BYTES + 1)
    with pytest.raises(FrameError, match="exceeds"):
        parse_header(header)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode([["nope", 1, 2]]),
                                     msgspec.msgpack.encode({"a": 1}), b""])
def test_malformed_payload_is_refused(payload):
    with pytest.raises(FrameError, match="malformed"):
        decode_payload(payload)


def test_step_records_are_not_tracked_by_the_garbage_collector():
    import gc

    assert not gc.is_tracked(step(0))
