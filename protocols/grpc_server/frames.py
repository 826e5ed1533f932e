"""HTTP/2 framing for a gRPC server (RFC 9113): frames cut from bytes, frames built
to bytes, and the HPACK literals our answers need. Pure: no sockets, no asyncio.

Only what a server answering gRPC calls sends is built: HEADERS (answers and
trailers), DATA, SETTINGS, PING, RST_STREAM, GOAWAY and WINDOW_UPDATE. Answers are
HPACK literals "without indexing" (RFC 7541 §6.2.2) and no Huffman coding: they leave
the peer's decoding table as it is, so the same bytes are valid on every stream and
connection, whatever table size the peer asked for, and most are built once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

__all__ = [
    "CONNECTION_PREFACE",
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_WINDOW",
    "MAX_WINDOW",
    "ErrorCode",
    "Flag",
    "Frame",
    "FrameError",
    "FrameType",
    "Setting",
    "cut_frames",
    "data_frames",
    "frame",
    "goaway",
    "headers_block",
    "headers_frames",
    "ping_ack",
    "rst_stream",
    "settings",
    "settings_ack",
    "strip_padding",
    "window_update",
]

CONNECTION_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_MAX_FRAME_SIZE: Final = 16_384
DEFAULT_WINDOW: Final = 65_535
MAX_WINDOW: Final = (1 << 31) - 1
_HEAD = struct.Struct(">IBI")  # 24-bit length << 8 | type, flags, stream id
_HEAD_SIZE: Final = 9


class FrameType:
    DATA: Final = 0x0
    HEADERS: Final = 0x1
    PRIORITY: Final = 0x2
    RST_STREAM: Final = 0x3
    SETTINGS: Final = 0x4
    PUSH_PROMISE: Final = 0x5
    PING: Final = 0x6
    GOAWAY: Final = 0x7
    WINDOW_UPDATE: Final = 0x8
    CONTINUATION: Final = 0x9


class Flag:
    END_STREAM: Final = 0x1
    ACK: Final = 0x1
    END_HEADERS: Final = 0x4
    PADDED: Final = 0x8
    PRIORITY: Final = 0x20


class Setting:
    HEADER_TABLE_SIZE: Final = 0x1
    ENABLE_PUSH: Final = 0x2
    MAX_CONCURRENT_STREAMS: Final = 0x3
    INITIAL_WINDOW_SIZE: Final = 0x4
    MAX_FRAME_SIZE: Final = 0x5
    MAX_HEADER_LIST_SIZE: Final = 0x6


class ErrorCode:
    NO_ERROR: Final = 0x0
    PROTOCOL_ERROR: Final = 0x1
    INTERNAL_ERROR: Final = 0x2
    FLOW_CONTROL_ERROR: Final = 0x3
    STREAM_CLOSED: Final = 0x5
    FRAME_SIZE_ERROR: Final = 0x6
    REFUSED_STREAM: Final = 0x7
    CANCEL: Final = 0x8
    COMPRESSION_ERROR: Final = 0x9
    ENHANCE_YOUR_CALM: Final = 0xB


class FrameError(Exception):
    """A connection error (RFC 9113 §5.4.1): the connection ends with a GOAWAY
    carrying :attr:`code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


# (type, flags, stream id, payload)
Frame = tuple[int, int, int, bytes]


def cut_frames(buffer: bytes | bytearray, max_size: int) -> tuple[list[Frame], int]:
    """The whole frames at the start of ``buffer`` and how many bytes they took; a
    frame longer than ``max_size`` (our SETTINGS_MAX_FRAME_SIZE) is a FrameError
    before its payload is awaited, so a peer cannot make us buffer it."""
    frames: list[Frame] = []
    at, end = 0, len(buffer)
    view = memoryview(buffer)
    while end - at >= _HEAD_SIZE:
        head, flags, stream = _HEAD.unpack_from(buffer, at)
        length = head >> 8
        if length > max_size:
            raise FrameError(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
        if end - at - _HEAD_SIZE < length:
            break
        start = at + _HEAD_SIZE
        frames.append(
            (head & 0xFF, flags, stream & 0x7FFFFFFF, bytes(view[start : start + length]))
        )
        at = start + length
    view.release()
    return frames, at


def strip_padding(flags: int, payload: bytes, *, priority: bool = False) -> bytes:
    """A DATA or HEADERS payload without its padding (and, for HEADERS, the priority
    fields)."""
    start, end = 0, len(payload)
    if flags & Flag.PADDED:
        if not payload:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "a padded frame without its pad length")
        start, end = 1, end - payload[0]
    if priority and flags & Flag.PRIORITY:
        start += 5
    if end < start:
        raise FrameError(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
    return payload if (start, end) == (0, len(payload)) else payload[start:end]


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(len(payload) << 8 | kind, flags, stream) + payload


def settings(values: Iterable[tuple[int, int]]) -> bytes:
    return frame(FrameType.SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in values))


def settings_ack() -> bytes:
    return frame(FrameType.SETTINGS, Flag.ACK, 0)


def ping_ack(payload: bytes) -> bytes:
    return frame(FrameType.PING, Flag.ACK, 0, payload)


def window_update(stream: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


def rst_stream(stream: int, code: int) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream, struct.pack(">I", code))


def goaway(last_stream: int, code: int, reason: str = "") -> bytes:
    debug = reason.encode("utf-8", "replace")[:256]
    return frame(FrameType.GOAWAY, 0, 0, struct.pack(">II", last_stream, code) + debug)


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) whose first byte carries ``first``'s high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def headers_block(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """Each header as a literal without indexing, new name, no Huffman coding."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00"
        out += _integer(len(name), 7, 0)
        out += name
        out += _integer(len(value), 7, 0)
        out += value
    return bytes(out)


def headers_frames(stream: int, block: bytes, max_size: int, *, end_stream: bool) -> bytes:
    """One HEADERS frame, or HEADERS then CONTINUATION frames for a block longer than
    the peer's frame size."""
    end = Flag.END_STREAM if end_stream else 0
    if len(block) <= max_size:
        return frame(FrameType.HEADERS, end | Flag.END_HEADERS, stream, block)
    parts = [block[i : i + max_size] for i in range(0, len(block), max_size)]
    out = [frame(FrameType.HEADERS, end, stream, parts[0])]
    for part in parts[1:-1]:
        out.append(frame(FrameType.CONTINUATION, 0, stream, part))
    out.append(frame(FrameType.CONTINUATION, Flag.END_HEADERS, stream, parts[-1]))
    return b"".join(out)


def data_frames(stream: int, data: bytes | memoryview, max_size: int) -> bytes:
    """``data`` as DATA frames of at most ``max_size`` bytes, none ending the stream."""
    if len(data) <= max_size:
        return _HEAD.pack(len(data) << 8 | FrameType.DATA, 0, stream) + data
    out = []
    for at in range(0, len(data), max_size):
        part = data[at : at + max_size]
        out.append(_HEAD.pack(len(part) << 8 | FrameType.DATA, 0, stream))
        out.append(bytes(part))
    return b"".join(out)
