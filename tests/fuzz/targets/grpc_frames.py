"""HTTP/2 as a gRPC client's bytes reach the server: :class:`Http2Connection` (frames,
HPACK header blocks, SETTINGS, flow control both ways, gRPC messages) with a fake
transport and a few generic methods (unary, server streaming, client streaming,
bidi, one whose handler fails), whose handlers run on a loop between the reads.

The first byte steers: its low 3 bits how the rest is cut into reads, bit 3 leaves
the connection preface to the input (else it is put before it), bit 4 pauses writing
before every other read (answers then wait on the transport).

Documented errors: none. The connection answers a bad peer itself (a GOAWAY, a
RST_STREAM, a status), so anything raised out of its callbacks, left to the loop's
exception handler, or logged with a traceback (but the failing handler's) is a
finding; so is output that is not whole HTTP/2 frames, a frame over the largest size
the input allowed, DATA beyond the windows the input granted, a stream's frames out
of order (DATA before its HEADERS, anything after its end), a header block hpack
cannot decode, a stream's DATA that is not whole gRPC messages, or a write after
the connection was closed.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import hpack

from polymq.protocols.grpc_server.calls import Call, Method
from polymq.protocols.grpc_server.connection import Http2Connection, Limits
from polymq.protocols.grpc_server.frames import (
    CONNECTION_PREFACE,
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_WINDOW,
    ErrorCode,
    Flag,
    FrameError,
    FrameType,
    Setting,
    cut_frames,
)
from polymq.protocols.grpc_server.wire import cut_messages

__all__ = ["one_input"]

_READS = (0, 1, 2, 7, 9, 64, 1000, 4096)  # 0: all at once
_LARGEST_FRAME = (1 << 24) - 1
_LIMITS = Limits(
    max_message_bytes=1024,
    handshake_timeout_s=60.0,
    max_concurrent_streams=4,
    max_header_list_bytes=1024,
    stream_window=4096,
)


class _HandlerFailed(Exception):
    """What the failing method's handler raises (the one traceback expected)."""


async def _echo(request: bytes, call: Call) -> bytes:
    return request


async def _count(request: bytes, call: Call) -> AsyncIterator[bytes]:
    for i in range(min(len(request), 4)):
        yield request[: i + 1]


async def _bidi(requests: AsyncIterator[bytes], call: Call) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


async def _total(requests: AsyncIterator[bytes], call: Call) -> bytes:
    return b"%d" % sum([len(request) async for request in requests])


async def _fail(request: bytes, call: Call) -> bytes:
    raise _HandlerFailed


METHODS = {
    b"/t/Echo": Method(_echo, bytes, bytes),
    b"/t/Count": Method(_count, bytes, bytes, server_streaming=True),
    b"/t/Bidi": Method(_bidi, bytes, bytes, client_streaming=True, server_streaming=True),
    b"/t/Total": Method(_total, bytes, bytes, client_streaming=True),
    b"/t/Fail": Method(_fail, bytes, bytes),
}


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closing = False
        self.late = 0  # bytes written after close or abort

    def write(self, data: bytes) -> None:
        if self.closing:
            self.late += len(data)
        self.out += data

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 50_000) if name == "peername" else default


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.failures: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and not isinstance(record.exc_info[1], _HandlerFailed):
            assert record.exc_info[1] is not None
            self.failures.append(record.exc_info[1])


_RECORDS = _Records()
_LOG = logging.getLogger("polymq.protocols.grpc_server")
_LOG.addHandler(_RECORDS)
_LOG.propagate = False
_LOOP = asyncio.new_event_loop()
_UNHANDLED: list[dict[str, Any]] = []
_LOOP.set_exception_handler(lambda _, context: _UNHANDLED.append(context))


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def _drive(mode: int, body: bytes) -> _Transport:
    transport = _Transport()
    connection = Http2Connection(METHODS, _LIMITS, lambda _: None, lambda _: None)
    connection.connection_made(transport)  # type: ignore[arg-type]
    data = body if mode & 0x8 else CONNECTION_PREFACE + body
    size = _READS[mode & 0x7] or max(1, len(data))
    for turn, at in enumerate(range(0, len(data), size)):
        if mode & 0x10 and turn % 2:
            connection.pause_writing()
            await _turns(2)
            connection.resume_writing()
        connection.data_received(data[at : at + size])
        await _turns(3)
        if transport.closing:
            break
    await _turns(3)
    connection.connection_lost(None)
    await _turns(3)
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    assert not left, f"tasks left after the connection was lost: {left}"
    return transport


def one_input(data: bytes) -> None:
    if not data:
        return
    transport = _LOOP.run_until_complete(_drive(data[0], data[1:]))
    if _RECORDS.failures:
        failure = _RECORDS.failures[0]
        _RECORDS.failures.clear()
        raise failure
    if _UNHANDLED:
        context = _UNHANDLED[0]
        _UNHANDLED.clear()
        raise AssertionError(f"left to the loop's exception handler: {context}")
    assert not transport.late, f"{transport.late} bytes written after the connection closed"
    sent = data[1:] if data[0] & 0x8 else CONNECTION_PREFACE + data[1:]
    _check_answers(bytes(transport.out), _Granted(sent))


class _Granted:
    """The most the client's bytes allowed, read in order and leniently (frames past
    where the server stopped reading only raise the bounds): the largest frame size
    it announced, and the flow-control windows it gave: the connection's, and each
    stream's (the largest initial window in force while it was open, plus its
    increments)."""

    def __init__(self, sent: bytes) -> None:
        self.frame_size = DEFAULT_MAX_FRAME_SIZE
        self.connection = DEFAULT_WINDOW
        self.streams: dict[int, int] = {}
        if not sent.startswith(CONNECTION_PREFACE):
            return
        try:
            frames, _ = cut_frames(sent[len(CONNECTION_PREFACE) :], _LARGEST_FRAME)
        except FrameError:
            return
        initial = DEFAULT_WINDOW
        increments: defaultdict[int, int] = defaultdict(int)
        for kind, flags, stream, payload in frames:
            if kind == FrameType.HEADERS and stream not in self.streams:
                self.streams[stream] = initial
            elif kind == FrameType.SETTINGS and not flags & Flag.ACK:
                for at in range(0, len(payload) - len(payload) % 6, 6):
                    key, value = struct.unpack_from(">HI", payload, at)
                    if key == Setting.MAX_FRAME_SIZE:
                        self.frame_size = max(self.frame_size, min(value, _LARGEST_FRAME))
                    elif key == Setting.INITIAL_WINDOW_SIZE:
                        initial = value
                        for opened, most in self.streams.items():
                            self.streams[opened] = max(most, value)
            elif kind == FrameType.WINDOW_UPDATE and len(payload) == 4:
                increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                if stream:
                    increments[stream] += increment
                else:
                    self.connection += increment
        for stream, increment in increments.items():
            if stream in self.streams:
                self.streams[stream] += increment

    def stream_window(self, stream: int) -> int:
        return self.streams.get(stream, 0)


def _check_answers(out: bytes, granted: _Granted) -> None:
    frames, used = cut_frames(out, granted.frame_size)  # FrameError: a frame too long
    assert used == len(out), f"{len(out) - used} bytes after the last whole frame"
    decoder = hpack.Decoder(max_header_list_size=1 << 20)
    block: bytearray | None = None  # a header block awaiting CONTINUATION
    started: set[int] = set()  # streams whose response headers went out
    ended: set[int] = set()
    data: defaultdict[int, bytearray] = defaultdict(bytearray)
    sent_total = 0
    for at, (kind, flags, stream, payload) in enumerate(frames):
        assert block is None or kind == FrameType.CONTINUATION, f"frame {at}: inside a block"
        assert stream not in ended or kind in (FrameType.RST_STREAM, FrameType.WINDOW_UPDATE), (
            f"frame {at}: after its stream's end"
        )
        if kind in (FrameType.SETTINGS, FrameType.PING, FrameType.GOAWAY):
            assert stream == 0, f"frame {at}: on a stream"
        elif kind in (FrameType.HEADERS, FrameType.DATA, FrameType.RST_STREAM):
            assert stream % 2 == 1, f"frame {at}: on stream {stream}"
        if kind == FrameType.GOAWAY:
            code = struct.unpack_from(">I", payload, 4)[0]
            assert code == ErrorCode.NO_ERROR or at == len(frames) - 1, "frames after a GOAWAY"
        elif kind == FrameType.HEADERS:
            started.add(stream)
            if flags & Flag.END_STREAM:
                ended.add(stream)
            block = bytearray()
        elif kind == FrameType.DATA:
            assert stream in started, f"frame {at}: DATA before the stream's headers"
            data[stream] += payload
            sent_total += len(payload)
        if kind in (FrameType.HEADERS, FrameType.CONTINUATION):
            assert block is not None, f"frame {at}: a CONTINUATION out of place"
            block += payload
            if flags & Flag.END_HEADERS:
                decoder.decode(bytes(block), raw=True)
                block = None
    assert sent_total <= granted.connection, "DATA beyond the connection window"
    for stream, answered in data.items():
        assert len(answered) <= granted.stream_window(stream), f"DATA beyond {stream}'s window"
        if stream in ended:
            messages = bytearray(answered)
            cut_messages(messages, 1 << 20)
            assert not messages, f"stream {stream} ended inside a message"
