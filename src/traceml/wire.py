"""How records travel from a rank to the collector: frames.

A frame is a fixed header (magic, version, payload length) followed by a msgpack payload: a list
of tagged records (record_types.py: those sent), each encoded as an array, so field order is part
of the wire version. The collector rejects a frame with the wrong magic or version, or one larger
than MAX_FRAME_BYTES, by closing that connection only.
"""
import struct
from typing import List, Union

import msgspec

from traceml.record_types import RECORD_TYPES

WIRE_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">2sBxI")  # magic, version, pad, payload length
HEADER_BYTES = _HEADER.size
_MAGIC = b"TM"

Record = msgspec.Struct  # one of the record types sent, told apart by its tag
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(List[Union[tuple(kind.record for kind in RECORD_TYPES.values()  # type: ignore
                                                    if kind.sent)]])


class FrameError(ValueError):
    """A frame that cannot be trusted: the connection that sent it is closed."""


def encode_frame(records: List[Record]) -> bytes:
    payload = _encoder.encode(records)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(_MAGIC, WIRE_VERSION, len(payload)) + payload


def parse_header(header: bytes) -> int:
    """Validate a frame header and return the payload length that follows it."""
    magic, version, length = _HEADER.unpack(header)
    if magic != _MAGIC:
        raise FrameError("bad magic: not a TraceML frame")
    if version != WIRE_VERSION:
        raise FrameError(f"wire version {version}, expected {WIRE_VERSION}")
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length


def decode_payload(payload: bytes) -> List[Record]:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, ValueError,
            OverflowError, RecursionError) as exc:  # a string that is not UTF-8 included
        raise FrameError(f"malformed payload: {exc}") from None
