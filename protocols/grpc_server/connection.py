"""One HTTP/2 connection serving gRPC calls, as the loop's protocol.

Why our own: grpcio's server costs about 300 µs of CPU per unary call here, most of
the RocketMQ path (docs/rocketmq.md); this one frames what a gRPC server needs with
no task, future or copy it can do without. A unary call is one task, one parse, one
write of its answer (headers, message and trailers together).

Flow control: our window to the peer grows back as the peer's bytes are taken (a
unary request when its call starts, a streamed one when its handler reads it), so
what one connection holds unread is bounded by its connection window; a stream's own
window is given back as its bytes arrive. Our answers wait for the peer's windows
and its frame size; a handler streaming answers waits while the transport is full.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, cast

import hpack
import hpack.exceptions

from polymq.gateway.lazy_deadline import LazyDeadline
from polymq.protocols.grpc_server import frames as f
from polymq.protocols.grpc_server.calls import Call, Inbox, Method
from polymq.protocols.grpc_server.frames import ErrorCode, Flag, FrameError, FrameType, Setting
from polymq.protocols.grpc_server.wire import (
    MESSAGE_PREFIX,
    RESPONSE_HEADERS,
    MessageTooLarge,
    StatusCode,
    cut_messages,
    message_bytes,
    metadata,
    parse_timeout,
    status_block,
)

__all__ = ["Http2Connection", "Limits"]

log = logging.getLogger(__name__)

_OK_TRAILERS: Final = status_block(StatusCode.OK)
_KEEPALIVE_PING: Final = b"polymq\x00\x00"
# Streams we reset are remembered this many at a time, so that frames the peer sent
# before it read the reset are ignored (a peer's frames in flight, not a bound).
_RESET_STREAMS_KEPT: Final = 128
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What the server takes from one connection."""

    max_message_bytes: int
    handshake_timeout_s: float  # for the preface and the first SETTINGS
    write_timeout_s: float = 60.0  # for a peer that stops reading its answers
    # A peer silent this long is pinged, and cut if the ping is not answered in time:
    # a peer gone without a word (its machine, its network) holds nothing for long.
    keepalive_s: float = 60.0
    ping_timeout_s: float = 20.0
    max_concurrent_streams: int = 1000
    max_header_list_bytes: int = 16 << 10
    stream_window: int = 1 << 20

    @property
    def held_bytes(self) -> int:
        """What one connection may hold of requests not yet served: two whole messages
        of the largest size, and at least 4 MiB."""
        return min(f.MAX_WINDOW, max(self.max_message_bytes * 2, 4 << 20))

    @property
    def connection_window(self) -> int:
        return self.held_bytes


class _Stream:
    __slots__ = (
        "call",
        "headers_sent",
        "id",
        "inbox",
        "method",
        "pending",
        "received",
        "recv_owed",
        "recv_window",
        "remote_closed",
        "request",
        "request_size",
        "reserved",
        "send_window",
        "space",
        "task",
        "trailers",
        "waiting",
    )

    def __init__(
        self, stream_id: int, method: Method, call: Call, send_window: int, recv_window: int
    ) -> None:
        self.id = stream_id
        self.method = method
        self.call = call
        self.received = bytearray()  # a message's bytes not yet whole
        self.request: Any = None
        self.inbox: Inbox | None = None
        self.remote_closed = False
        self.headers_sent = False
        self.pending = bytearray()  # answer bytes waiting for window
        self.trailers: bytes | None = None
        self.send_window = send_window
        self.recv_window = recv_window
        self.recv_owed = 0
        self.reserved = 0  # the unfinished message's announced size, counted as held
        self.request_size = 0  # a unary request's, held until its call starts
        self.waiting = 0  # the unfinished message's announced size, while it waits
        self.task: asyncio.Task[None] | None = None
        self.space: asyncio.Future[None] | None = None  # woken when pending drains


class Http2Connection(asyncio.Protocol):
    """A gRPC server's side of one HTTP/2 connection."""

    def __init__(
        self,
        methods: dict[bytes, Method],
        limits: Limits,
        made: Callable[[Http2Connection], None],
        gone: Callable[[Http2Connection], None],
    ) -> None:
        self._methods = methods
        self._limits = limits
        self._made = made
        self._gone = gone
        self._loop = asyncio.get_event_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._preface = False
        self._settled = False  # the peer's first SETTINGS came
        self._decoder = hpack.Decoder(max_header_list_size=limits.max_header_list_bytes)
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._headers_block: tuple[int, int, bytearray] | None = None  # awaiting CONTINUATION
        self._peer_frame_size = f.DEFAULT_MAX_FRAME_SIZE
        self._peer_stream_window = f.DEFAULT_WINDOW
        self._send_window = f.DEFAULT_WINDOW
        self._recv_window = limits.connection_window
        # Window given back in steps of a quarter: one WINDOW_UPDATE per many calls.
        self._credit_step = limits.connection_window >> 2
        self._recv_owed = 0
        # Bytes of requests received and not yet taken by their calls (an unfinished
        # message counted at its announced size from its prefix on).
        self._held = 0
        self._waiting: dict[int, _Stream] = {}  # streams whose message waits for the budget
        self._blocked: dict[int, _Stream] = {}  # streams with answer bytes waiting for window
        self._reset_streams: dict[int, None] = {}  # the last ones we reset, oldest first
        self._paused: asyncio.Future[None] | None = None
        self._closing = False
        self._draining = False
        self._handshake: asyncio.TimerHandle | None = None
        self._stalled: asyncio.TimerHandle | None = None  # while writing is paused
        self._quiet = LazyDeadline(self._loop, self._heard_nothing, limits.keepalive_s)
        self._pinged = False
        self.peer = ""

    # -- the loop's protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass of it)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer = _grpc_peer(transport.get_extra_info("peername"))
        limits = self._limits
        transport.write(
            f.settings(
                (
                    (Setting.MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
                    (Setting.INITIAL_WINDOW_SIZE, limits.stream_window),
                    (Setting.MAX_HEADER_LIST_SIZE, limits.max_header_list_bytes),
                    (Setting.ENABLE_PUSH, 0),
                )
            )
            + f.window_update(0, limits.connection_window - f.DEFAULT_WINDOW)
        )
        self._handshake = self._loop.call_later(limits.handshake_timeout_s, self._handshake_late)
        self._quiet.start(self._loop.time() + limits.keepalive_s)
        self._made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._handshake is not None:
            self._handshake.cancel()
        if self._stalled is not None:
            self._stalled.cancel()
        self._quiet.close()
        for stream in list(self._streams.values()):
            self._drop(stream)
        self._streams.clear()
        self._blocked.clear()
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        self._gone(self)

    def pause_writing(self) -> None:
        """The peer reads slower than we answer: read nothing more from it (so it asks
        for no more answers, pings or resets) until it catches up, and cut it if it
        has not within ``write_timeout_s``."""
        if self._paused is None or self._paused.done():
            self._paused = self._loop.create_future()
        if self._transport is not None:
            self._transport.pause_reading()
        if self._stalled is None:
            self._stalled = self._loop.call_later(self._limits.write_timeout_s, self._stall)

    def resume_writing(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()

    def _stall(self) -> None:
        self._stalled = None
        log.info("grpc connection from %s closed: it stopped reading its answers", self.peer)
        self.abort()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._pinged = False
        self._quiet.start(self._loop.time() + self._limits.keepalive_s)
        buffer = self._buffer
        buffer += data
        out: list[bytes] = []
        try:
            if not self._preface:
                if len(buffer) < len(f.CONNECTION_PREFACE):
                    if not f.CONNECTION_PREFACE.startswith(bytes(buffer)):
                        raise FrameError(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 preface")
                    return
                if buffer[: len(f.CONNECTION_PREFACE)] != f.CONNECTION_PREFACE:
                    raise FrameError(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 preface")
                del buffer[: len(f.CONNECTION_PREFACE)]
                self._preface = True
            cut, used = f.cut_frames(buffer, f.DEFAULT_MAX_FRAME_SIZE)
            if used:
                del buffer[:used]
            for kind, flags, stream_id, payload in cut:
                self._frame(kind, flags, stream_id, payload, out)
            if self._recv_owed >= self._credit_step:
                self._credit(out)
            if self._waiting:
                self._admit()
        except FrameError as e:
            out.append(f.goaway(self._last_stream, e.code, str(e)))
            log.info("grpc connection from %s closed: %s", self.peer, e)
            self._write(out)
            self.close()
            return
        except Exception:  # a bug of ours: this connection ends, the server serves on
            log.exception("grpc connection from %s failed; closing it", self.peer)
            self.abort()
            return
        if out:
            self._write(out)

    def _heard_nothing(self) -> None:
        if self._closing:
            return
        if self._pinged:
            log.info("grpc connection from %s closed: its peer answers no ping", self.peer)
            self.abort()
            return
        self._pinged = True
        self._write([f.frame(FrameType.PING, 0, 0, _KEEPALIVE_PING)])
        self._quiet.start(self._loop.time() + self._limits.ping_timeout_s)

    def _handshake_late(self) -> None:
        self._handshake = None
        if not self._settled:
            log.info("grpc connection from %s closed: no HTTP/2 preface in time", self.peer)
            if self._transport is not None:
                self._transport.abort()

    def close(self) -> None:
        """Close after what was written; the calls are cancelled."""
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def drain(self) -> None:
        """Tell the peer to open no more streams here, and close once the calls under
        way have ended (a stopping server)."""
        self._draining = True
        self._write([f.goaway(self._last_stream, ErrorCode.NO_ERROR)])
        if not self._streams:
            self.close()

    def abort(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.abort()

    def _forget(self, stream: _Stream) -> None:
        self._streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)
        if self._draining and not self._streams:
            self.close()

    # -- frames in -----------------------------------------------------------------------

    def _frame(
        self, kind: int, flags: int, stream_id: int, payload: bytes, out: list[bytes]
    ) -> None:
        if self._headers_block is not None and kind != FrameType.CONTINUATION:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "a header block left unfinished")
        if not self._settled and kind != FrameType.SETTINGS:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "the first frame is not SETTINGS")
        if kind == FrameType.DATA:
            self._data(flags, stream_id, payload, out)
        elif kind == FrameType.HEADERS:
            if stream_id == 0:
                raise FrameError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
            block = f.strip_padding(flags, payload, priority=True)
            if flags & Flag.END_HEADERS:
                self._headers(stream_id, flags, block, out)
            else:
                self._headers_block = (stream_id, flags, bytearray(block))
        elif kind == FrameType.CONTINUATION:
            self._continuation(flags, stream_id, payload, out)
        elif kind == FrameType.SETTINGS:
            self._settings(flags, stream_id, payload, out)
        elif kind == FrameType.WINDOW_UPDATE:
            self._window_update(stream_id, payload, out)
        elif kind == FrameType.PING:
            if len(payload) != 8 or stream_id:
                raise FrameError(
                    ErrorCode.FRAME_SIZE_ERROR, "a PING that is not 8 bytes on stream 0"
                )
            if not flags & Flag.ACK:
                out.append(f.ping_ack(payload))
        elif kind == FrameType.RST_STREAM:
            if len(payload) != 4 or not stream_id:
                raise FrameError(ErrorCode.FRAME_SIZE_ERROR, "a malformed RST_STREAM")
            stream = self._streams.get(stream_id)
            if stream is not None:
                self._forget(stream)
                self._drop(stream)
        elif kind == FrameType.GOAWAY:
            if stream_id:
                raise FrameError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if not self._streams:
                self.close()
        elif kind == FrameType.PRIORITY:
            if len(payload) != 5 or not stream_id:
                raise FrameError(ErrorCode.FRAME_SIZE_ERROR, "a malformed PRIORITY")
        elif kind == FrameType.PUSH_PROMISE:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "a client cannot push")
        # other types are extensions, ignored (RFC 9113 §5.5)

    def _settings(self, flags: int, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        if stream_id:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & Flag.ACK:
            if payload:
                raise FrameError(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS ack with a payload")
            return
        if len(payload) % 6:
            raise FrameError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        for at in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, at)
            if key == Setting.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise FrameError(ErrorCode.FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta = value - self._peer_stream_window
                self._peer_stream_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == Setting.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME_SIZE <= value <= (1 << 24) - 1:
                    raise FrameError(ErrorCode.PROTOCOL_ERROR, "a max frame size out of range")
                self._peer_frame_size = value
            elif key == Setting.ENABLE_PUSH and value > 1:
                raise FrameError(ErrorCode.PROTOCOL_ERROR, "ENABLE_PUSH neither 0 nor 1")
        out.append(f.settings_ack())
        if not self._settled:
            self._settled = True
            if self._handshake is not None:
                self._handshake.cancel()
                self._handshake = None
        self._push_blocked(out)

    def _window_update(self, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        if len(payload) != 4:
            raise FrameError(ErrorCode.FRAME_SIZE_ERROR, "a WINDOW_UPDATE that is not 4 bytes")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise FrameError(ErrorCode.PROTOCOL_ERROR, "a window update of 0")
            self._send_window += increment
            if self._send_window > f.MAX_WINDOW:
                raise FrameError(ErrorCode.FLOW_CONTROL_ERROR, "a connection window over 2^31-1")
            self._push_blocked(out)
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # a stream ended meanwhile
        if not increment or stream.send_window + increment > f.MAX_WINDOW:
            self._reset(stream, ErrorCode.FLOW_CONTROL_ERROR, out)
            return
        stream.send_window += increment
        if stream.pending:
            self._push(stream, out)

    def _continuation(self, flags: int, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        if self._headers_block is None or self._headers_block[0] != stream_id:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "a CONTINUATION out of place")
        _, first_flags, block = self._headers_block
        block += payload
        if len(block) > self._limits.max_header_list_bytes:
            raise FrameError(ErrorCode.ENHANCE_YOUR_CALM, "a header block over the limit")
        if flags & Flag.END_HEADERS:
            self._headers_block = None
            self._headers(stream_id, first_flags, bytes(block), out)

    def _headers(self, stream_id: int, flags: int, block: bytes, out: list[bytes]) -> None:
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.exceptions.HPACKError as e:
            raise FrameError(
                ErrorCode.COMPRESSION_ERROR, f"a header block HPACK cannot read: {e}"
            ) from e
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client: only an end of stream
            if stream.remote_closed:
                raise FrameError(ErrorCode.STREAM_CLOSED, "headers after the end of a stream")
            if not flags & Flag.END_STREAM:
                raise FrameError(
                    ErrorCode.PROTOCOL_ERROR, "a second header block not ending its stream"
                )
            self._remote_end(stream, out)
            return
        if stream_id in self._reset_streams:
            return  # the peer's trailers crossed our RST_STREAM: ignored (RFC 9113 §5.1)
        if stream_id % 2 == 0 or stream_id <= self._last_stream:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, f"a new stream {stream_id} out of order")
        self._last_stream = stream_id
        if self._draining or len(self._streams) >= self._limits.max_concurrent_streams:
            self._reset_stream(stream_id, ErrorCode.REFUSED_STREAM, out)
            return
        path = method_name = b""
        timeout: float | None = None
        grpc = False
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method_name = value
            elif name == b"content-type":
                grpc = value.startswith(b"application/grpc")
            elif name == b"grpc-timeout":
                timeout = parse_timeout(value)
        method = self._methods.get(path)
        end_stream = bool(flags & Flag.END_STREAM)
        if method is None or method_name != b"POST" or not grpc:
            if method is None:
                shown = path.decode("utf-8", "replace")[:200]
                refusal = status_block(
                    StatusCode.UNIMPLEMENTED, f"Method not found: {shown}", trailers_only=True
                )
            else:
                refusal = status_block(
                    StatusCode.INTERNAL, "not a gRPC request", trailers_only=True
                )
            out.append(f.headers_frames(stream_id, refusal, self._peer_frame_size, end_stream=True))
            if not end_stream:
                self._reset_stream(stream_id, ErrorCode.NO_ERROR, out)
            return
        deadline = self._loop.time() + timeout if timeout is not None else None
        call = Call(self.peer, metadata(headers), deadline, self._loop)
        stream = _Stream(
            stream_id, method, call, self._peer_stream_window, self._limits.stream_window
        )
        self._streams[stream_id] = stream
        if method.client_streaming:
            stream.inbox = Inbox(lambda size: self._inbox_taken(stream, size))
            self._start(stream, stream.inbox)
        if end_stream:
            self._remote_end(stream, out)

    def _data(self, flags: int, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        if stream_id == 0:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise FrameError(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        # The connection's window is given back as bytes arrive (what they may make us
        # hold is bounded by _held's budget instead).
        self._recv_owed += size
        stream = self._streams.get(stream_id)
        if stream is None or stream.remote_closed:
            if stream_id > self._last_stream:
                raise FrameError(ErrorCode.PROTOCOL_ERROR, "DATA on a stream never opened")
            return  # a stream ended meanwhile: its bytes are dropped
        stream.recv_window -= size
        if stream.recv_window < 0:
            self._reset(stream, ErrorCode.FLOW_CONTROL_ERROR, out)
            return
        stream.received += f.strip_padding(flags, payload)
        stream.recv_owed += size
        try:
            messages, compressed = cut_messages(stream.received, self._limits.max_message_bytes)
        except MessageTooLarge as e:
            self._refuse(stream, StatusCode.RESOURCE_EXHAUSTED, str(e), out)
            return
        if compressed:
            self._refuse(
                stream, StatusCode.UNIMPLEMENTED, "compressed messages are not accepted", out
            )
            return
        self._held -= stream.reserved  # the unfinished message, if whole now, is in messages
        stream.reserved = 0
        for message in messages:
            self._held += len(message) + MESSAGE_PREFIX  # until its call takes it
            self._message(stream, message, out)
            if stream.id not in self._streams:
                return
        if len(stream.received) >= MESSAGE_PREFIX:
            self._reserve(stream)
        elif stream.waiting:  # its message came whole within the window it had
            del self._waiting[stream.id]
            stream.waiting = 0
        if flags & Flag.END_STREAM:
            self._remote_end(stream, out)
        elif stream.recv_owed >= self._limits.stream_window >> 1 and self._may_send(stream):
            self._credit_stream(stream, out)

    def _reserve(self, stream: _Stream) -> None:
        """Count the unfinished message's announced size as held from its prefix on; if
        the connection would hold more than its budget, the stream waits, its window
        shut, until what others hold is taken by their calls. So what a connection
        holds of requests not yet served is bounded (its budget, plus at most a
        stream window per waiting stream), and a message once counted always gets its
        bytes: no stream waits on another's unfinished one."""
        announced = MESSAGE_PREFIX + int.from_bytes(stream.received[1:MESSAGE_PREFIX], "big")
        if self._waiting and stream.id not in self._waiting:
            self._waiting[stream.id] = stream  # (behind those waiting already)
            stream.waiting = announced
        elif self._held + announced <= self._limits.held_bytes:
            self._waiting.pop(stream.id, None)
            stream.reserved, stream.waiting = announced, 0
            self._held += announced
        else:
            self._waiting[stream.id] = stream
            stream.waiting = announced

    def _admit(self) -> None:
        """Count the waiting streams' messages, in turn, while they fit the budget."""
        out: list[bytes] = []
        for stream in list(self._waiting.values()):
            if self._held + stream.waiting > self._limits.held_bytes:
                break
            del self._waiting[stream.id]
            stream.reserved, stream.waiting = stream.waiting, 0
            self._held += stream.reserved
            if stream.recv_owed and self._may_send(stream):
                self._credit_stream(stream, out)
        self._write(out)

    def _unhold(self, size: int) -> None:
        self._held -= size
        if self._waiting:
            self._admit()

    def _may_send(self, stream: _Stream) -> bool:
        """Whether the stream's window may open: not while its message waits for the
        budget, nor while its handler has a window's worth of requests unread."""
        if stream.waiting:
            return False
        return stream.inbox is None or stream.inbox.held < self._limits.stream_window

    def _credit_stream(self, stream: _Stream, out: list[bytes]) -> None:
        out.append(f.window_update(stream.id, stream.recv_owed))
        stream.recv_window += stream.recv_owed
        stream.recv_owed = 0

    def _inbox_taken(self, stream: _Stream, size: int) -> None:
        """A streamed request was read by its handler: no longer held, and the stream's
        window, kept shut while its handler lagged, may open again."""
        self._unhold(size)
        if (
            self._streams.get(stream.id) is stream
            and not stream.remote_closed
            and stream.recv_owed >= self._limits.stream_window >> 1
            and self._may_send(stream)
        ):
            out: list[bytes] = []
            self._credit_stream(stream, out)
            self._write(out)

    def _message(self, stream: _Stream, message: bytes, out: list[bytes]) -> None:
        size = len(message) + MESSAGE_PREFIX
        try:
            request = stream.method.parse(message)
        except Exception:  # (a service's parser answers what it can parse; this is a bug)
            log.exception("grpc call from %s: its request could not be parsed", self.peer)
            self._unhold(size)
            self._refuse(stream, StatusCode.INTERNAL, "the request could not be parsed", out)
            return
        if stream.inbox is not None:
            stream.inbox.put(request, size)
            return
        if stream.request is not None:
            self._unhold(size)
            self._refuse(stream, StatusCode.UNIMPLEMENTED, "a second request on a unary call", out)
            return
        stream.request = request
        stream.request_size = size

    def _remote_end(self, stream: _Stream, out: list[bytes]) -> None:
        stream.remote_closed = True
        self._drop_unfinished(stream)
        if stream.inbox is not None:
            stream.inbox.end()
            return
        if stream.request is None:
            self._refuse(stream, StatusCode.INTERNAL, "no request message", out)
            return
        size, stream.request_size = stream.request_size, 0
        self._unhold(size)  # taken by its call
        self._start(stream, stream.request)

    # -- calls ---------------------------------------------------------------------------

    def _start(self, stream: _Stream, argument: Any) -> None:
        method = stream.method
        if method.server_streaming:
            coroutine = self._stream_answers(stream, argument)
        else:
            coroutine = self._answer_once(stream, argument)
        stream.task = self._loop.create_task(coroutine)

    async def _answer_once(self, stream: _Stream, request: Any) -> None:
        try:
            answer = stream.method.serialize(await stream.method.handler(request, stream.call))
        except asyncio.CancelledError:
            raise
        except Exception:
            self._failed(stream)
            return
        if self._streams.get(stream.id) is not stream:
            return
        out: list[bytes] = []
        message = message_bytes(answer)
        size = len(message)
        if (
            not stream.pending
            and size <= self._send_window
            and size <= stream.send_window
            and size <= self._peer_frame_size
        ):
            # the usual case: headers, message and trailers in one write
            self._send_window -= size
            self._open_answer(stream, out)
            out.append(f.frame(FrameType.DATA, 0, stream.id, message))
            out.append(
                f.frame(
                    FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, stream.id, _OK_TRAILERS
                )
            )
            self._write(out)
            self._forget(stream)  # (a unary call starts once its request is whole)
            return
        self._queue(stream, message, out)
        stream.trailers = _OK_TRAILERS
        self._push(stream, out)
        self._write(out)

    async def _stream_answers(self, stream: _Stream, argument: Any) -> None:
        serialize = stream.method.serialize
        try:
            async for answer in stream.method.handler(argument, stream.call):
                if self._streams.get(stream.id) is not stream:
                    return
                out: list[bytes] = []
                self._queue(stream, message_bytes(serialize(answer)), out)
                self._push(stream, out)
                self._write(out)
                await self._room(stream)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._failed(stream)
            return
        if self._streams.get(stream.id) is not stream:
            return
        out = []
        stream.trailers = _OK_TRAILERS
        self._push(stream, out)
        self._write(out)

    def _failed(self, stream: _Stream) -> None:
        """The handler raised (a bug: services answer their errors with a status)."""
        log.exception("grpc call from %s failed", self.peer)
        self._end_with(stream, StatusCode.UNKNOWN, "the server failed this call")

    async def _room(self, stream: _Stream) -> None:
        """Wait while the stream's answers wait for window or the transport is full."""
        while stream.pending and self._streams.get(stream.id) is stream:
            stream.space = self._loop.create_future()
            await stream.space
        paused = self._paused
        if paused is not None:
            await paused

    def _end_with(self, stream: _Stream, code: int, message: str) -> None:
        if self._streams.get(stream.id) is not stream:
            return
        out: list[bytes] = []
        if not stream.headers_sent:
            stream.pending.clear()
            block = status_block(code, message, trailers_only=True)
            out.append(f.headers_frames(stream.id, block, self._peer_frame_size, end_stream=True))
            self._finished(stream, out)
        else:
            stream.trailers = status_block(code, message)
            self._push(stream, out)
        self._write(out)

    def _refuse(self, stream: _Stream, code: int, message: str, out: list[bytes]) -> None:
        """End a call that cannot be served, from within the frames' handling."""
        if stream.task is not None:
            stream.task.cancel()
        stream.pending.clear()
        stream.trailers = None
        block = status_block(code, message, trailers_only=not stream.headers_sent)
        out.append(f.headers_frames(stream.id, block, self._peer_frame_size, end_stream=True))
        self._finished(stream, out)

    # -- answers out ---------------------------------------------------------------------

    def _open_answer(self, stream: _Stream, out: list[bytes]) -> None:
        """The answer's HEADERS: once, before its first message or its trailers."""
        if not stream.headers_sent:
            stream.headers_sent = True
            out.append(f.frame(FrameType.HEADERS, Flag.END_HEADERS, stream.id, RESPONSE_HEADERS))

    def _queue(self, stream: _Stream, message: bytes, out: list[bytes]) -> None:
        self._open_answer(stream, out)
        stream.pending += message

    def _push(self, stream: _Stream, out: list[bytes]) -> None:
        """Send what the windows allow of the stream's answer bytes, then its trailers."""
        pending = stream.pending
        if pending:
            size = min(len(pending), self._send_window, stream.send_window)
            if size > 0:
                out.append(
                    f.data_frames(stream.id, memoryview(pending)[:size], self._peer_frame_size)
                )
                del pending[:size]
                self._send_window -= size
                stream.send_window -= size
            if pending:
                self._blocked[stream.id] = stream
                return
        self._blocked.pop(stream.id, None)
        space = stream.space
        if space is not None and not space.done():
            space.set_result(None)
        if stream.trailers is not None:
            self._open_answer(stream, out)
            out.append(
                f.headers_frames(stream.id, stream.trailers, self._peer_frame_size, end_stream=True)
            )
            stream.trailers = None
            self._finished(stream, out)

    def _push_blocked(self, out: list[bytes]) -> None:
        if not self._blocked:
            return
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            self._push(stream, out)

    def _finished(self, stream: _Stream, out: list[bytes]) -> None:
        """Our side of the stream ended: it is forgotten; a peer still sending on it is
        told to stop."""
        self._forget(stream)
        self._release(stream)
        if not stream.remote_closed:
            self._reset_stream(stream.id, ErrorCode.NO_ERROR, out)

    def _reset(self, stream: _Stream, code: int, out: list[bytes]) -> None:
        self._reset_stream(stream.id, code, out)
        self._forget(stream)
        self._drop(stream)

    def _reset_stream(self, stream_id: int, code: int, out: list[bytes]) -> None:
        """RST_STREAM to a peer that may still be sending on it: what it sent before
        reading that (DATA, its trailers) is ignored, not an error."""
        out.append(f.rst_stream(stream_id, code))
        reset = self._reset_streams
        reset[stream_id] = None
        if len(reset) > _RESET_STREAMS_KEPT:
            del reset[next(iter(reset))]

    def _drop(self, stream: _Stream) -> None:
        """The stream is gone (reset, or the connection lost): its call is cancelled and
        what it held is given back."""
        self._blocked.pop(stream.id, None)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        space = stream.space
        if space is not None and not space.done():
            space.set_result(None)
        self._release(stream)

    def _drop_unfinished(self, stream: _Stream) -> None:
        """The stream's unfinished message will not be completed: no longer held."""
        if self._waiting.pop(stream.id, None) is not None:
            stream.waiting = 0
        size, stream.reserved = stream.reserved, 0
        stream.received.clear()
        self._unhold(size)

    def _release(self, stream: _Stream) -> None:
        """Nothing the stream received will be served: none of it is held any more."""
        self._drop_unfinished(stream)
        size, stream.request_size = stream.request_size, 0
        if stream.inbox is not None:
            size += stream.inbox.discard()
        self._unhold(size)

    def _credit(self, out: list[bytes]) -> None:
        out.append(f.window_update(0, self._recv_owed))
        self._recv_window += self._recv_owed
        self._recv_owed = 0

    def _write(self, out: list[bytes]) -> None:
        transport = self._transport
        if out and transport is not None and not transport.is_closing():
            transport.write(b"".join(out) if len(out) > 1 else out[0])


def _grpc_peer(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    return f"unix:{address}" if address else "unknown"
