"""AMQP 0-9-1 frames: bytes in, frames out, and back (spec section 2.3.5, 4.2.3).

Pure: no sockets, no asyncio. The reader checks each frame's size against the
negotiated ``frame_max`` *before* waiting for its payload (so a peer announcing a
4 GiB frame is refused at once), decodes method arguments and content properties with
:mod:`protocols.amqp.fields` (bounded nesting, lengths checked against the bytes
present, linear time: pamqp's own decoder is none of these) into pamqp's classes,
keeps the raw properties of content headers (stored and served back byte for byte, so
every field-table type round-trips), and hands out frames in order as h11's
``next_event`` does. pamqp still encodes what the server sends.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from pamqp import commands, frame, header
from pamqp.base import Frame as MethodFrame
from pamqp.heartbeat import Heartbeat

from polymq.protocols.amqp.fields import FieldError, decode_arguments, decode_properties

__all__ = [
    "FRAME_BODY",
    "FRAME_HEADER",
    "FRAME_HEARTBEAT",
    "FRAME_METHOD",
    "HEARTBEAT_BYTES",
    "PROTOCOL_HEADER",
    "ContentHeaderFrame",
    "FrameError",
    "FrameReader",
    "InFrame",
    "ProtocolHeaderError",
    "WholePublish",
    "confirm_frame",
    "content_frames",
    "deliver_frames",
    "method_frame",
]

PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
FRAME_END: Final = 0xCE
HEARTBEAT_BYTES: Final = frame.marshal(Heartbeat(), 0)

_FRAME_HEAD = struct.Struct(">BHI")
_CONTENT_HEAD = struct.Struct(">HHQ")
_INDEX = struct.Struct(">I")
_BASIC_CLASS = 60


_FRAME_ERROR: Final = 501
_SYNTAX_ERROR: Final = 502
_DEFAULT_DEPTH: Final = 64


class FrameError(Exception):
    """The peer broke framing (``reply_code`` 501 FRAME_ERROR) or sent a method or
    content header whose fields do not parse (502 SYNTAX_ERROR, naming the method
    in ``class_id`` / ``method_id``): a connection error either way."""

    def __init__(
        self, text: str, *, reply_code: int = _FRAME_ERROR, class_id: int = 0, method_id: int = 0
    ) -> None:
        super().__init__(text)
        self.reply_code = reply_code
        self.class_id = class_id
        self.method_id = method_id


class ProtocolHeaderError(Exception):
    """The peer did not open with AMQP 0-9-1's header; the spec says to answer with
    ours and close (section 4.2.2)."""


@dataclass(frozen=True, slots=True)
class ContentHeaderFrame:
    """A content header: ``raw_properties`` is the property flags and list exactly as
    sent, kept so the message can be served back unchanged."""

    class_id: int
    body_size: int
    properties: commands.Basic.Properties
    raw_properties: bytes


InValue = MethodFrame | ContentHeaderFrame | bytes | Heartbeat


@dataclass(frozen=True, slots=True)
class InFrame:
    """One frame from the peer: a method, a content header, a body chunk (bytes) or
    a heartbeat, on ``channel``."""

    channel: int
    value: InValue


@dataclass(frozen=True, slots=True)
class WholePublish:
    """A basic.publish read with its content in one go (:meth:`FrameReader.next_publish`):
    ``frames`` is 3, or 2 for an empty body (no body frame)."""

    channel: int
    method: commands.Basic.Publish
    header: ContentHeaderFrame
    body: bytes
    frames: int


class FrameReader:
    """Accumulates bytes from the peer and yields whole frames.

    ``frame_max`` bounds a whole frame (header and end octet included), as the spec's
    connection.tune defines it; ``0`` means no limit beyond ``hard_max``. Field tables
    and arrays may nest ``max_depth`` levels."""

    def __init__(
        self,
        *,
        frame_max: int,
        hard_max: int,
        expect_header: bool = True,
        max_depth: int = _DEFAULT_DEPTH,
    ) -> None:
        self._buffer = bytearray()
        self._pos = 0
        self.frame_max = frame_max
        self._hard_max = hard_max
        self._max_depth = max_depth
        self.frames_read = 0  # whole frames handed out so far
        # A server reads the protocol header first; a client (in tests) does not.
        self._expect_header = expect_header

    def receive_data(self, data: bytes) -> None:
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out as frames."""
        return len(self._buffer) - self._pos

    def incomplete_frame(self) -> int | None:
        """The declared size of the frame whose head is here but whose rest is not
        (what reading it will cost), else ``None``."""
        available = len(self._buffer) - self._pos
        if self._expect_header or available < 7:
            return None
        size: int = _FRAME_HEAD.unpack_from(self._buffer, self._pos)[2]
        total = size + 8
        return total if available < total else None

    def next_frame(self) -> InFrame | None:
        """The next complete frame, or ``None`` until more bytes arrive.

        Raises :class:`ProtocolHeaderError` or :class:`FrameError` on bad input."""
        buffer, pos = self._buffer, self._pos
        available = len(buffer) - pos
        if self._expect_header:
            if available < 8:
                if bytes(buffer[pos : pos + 4]) != b"AMQP"[:available]:
                    raise ProtocolHeaderError("not an AMQP protocol header")
                return None
            received = bytes(buffer[pos : pos + 8])
            self._consume(8)
            self._expect_header = False
            if received != PROTOCOL_HEADER:
                raise ProtocolHeaderError(f"unsupported protocol header {received!r}")
            return InFrame(0, header.ProtocolHeader())  # type: ignore[arg-type]
        if available < 7:
            return None
        frame_type, channel, size = _FRAME_HEAD.unpack_from(buffer, pos)
        total = size + 8
        limit = self.frame_max or self._hard_max
        if total > limit:
            raise FrameError(f"frame of {total} bytes exceeds frame_max {limit}")
        if available < total:
            return None
        if buffer[pos + total - 1] != FRAME_END:
            raise FrameError("frame does not end with the frame-end octet")
        start = pos + 7
        payload = bytes(buffer[start : start + size])
        self._consume(total)
        self.frames_read += 1
        return InFrame(channel, _decode(frame_type, payload, self._max_depth))

    def next_publish(self) -> WholePublish | None:
        """A basic.publish whose content header and body (one frame, or none for an
        empty body) are all buffered, read in one go without a frame object each;
        ``None`` (nothing consumed) for anything else, which :meth:`next_frame` then
        reads frame by frame, raising whatever error it finds."""
        if self._expect_header:
            return None
        buffer, pos = self._buffer, self._pos
        end = len(buffer)
        limit = self.frame_max or self._hard_max
        head = _FRAME_HEAD.unpack_from
        if end - pos < 11:
            return None
        frame_type, channel, size = head(buffer, pos)
        method_end = pos + 7 + size
        if (
            frame_type != FRAME_METHOD
            or size + 8 > limit
            or method_end + 7 >= end
            or buffer[method_end] != FRAME_END
            or _INDEX.unpack_from(buffer, pos + 7)[0] != _PUBLISH_INDEX
        ):
            return None
        at = method_end + 1
        frame_type, header_channel, size = head(buffer, at)
        header_end = at + 7 + size
        if (
            frame_type != FRAME_HEADER
            or header_channel != channel
            or size < 14
            or size + 8 > limit
            or header_end >= end
            or buffer[header_end] != FRAME_END
        ):
            return None
        class_id, _, body_size = _CONTENT_HEAD.unpack_from(buffer, at + 7)
        header_payload = bytes(buffer[at + 7 : header_end])
        stop, frames = header_end + 1, 2
        body = b""
        if body_size:
            if end - stop < 7:
                return None
            frame_type, body_channel, size = head(buffer, stop)
            body_end = stop + 7 + size
            if (
                frame_type != FRAME_BODY
                or body_channel != channel
                or size != body_size
                or size + 8 > limit
                or body_end >= end
                or buffer[body_end] != FRAME_END
            ):
                return None
            body = bytes(buffer[stop + 7 : body_end])
            stop, frames = body_end + 1, 3
        method = _fast_publish(bytes(buffer[pos + 7 : method_end]))
        if method is None:
            return None
        try:
            properties = decode_properties(header_payload, 12, self._max_depth)
        except (FieldError, struct.error, IndexError, ValueError, OverflowError):
            return None
        self._consume(stop - pos)
        self.frames_read += frames
        header = ContentHeaderFrame(class_id, body_size, properties, header_payload[12:])
        return WholePublish(channel, method, header, body, frames)

    def _consume(self, count: int) -> None:
        self._pos += count
        if self._pos >= len(self._buffer):
            self._buffer.clear()
            self._pos = 0
        elif self._pos > 65536:
            del self._buffer[: self._pos]
            self._pos = 0


_PUBLISH_INDEX: Final = commands.Basic.Publish.index
_ACK_INDEX: Final = commands.Basic.Ack.index
_ACK_ARGS = struct.Struct(">qB")


def _fast_publish(payload: bytes) -> commands.Basic.Publish | None:
    """basic.publish read straight off the payload (the hot path of publishing), or
    ``None`` when anything is off (short, not UTF-8, trailing bytes): the generic
    decoder then reads it and raises the error it names."""
    try:
        exchange_end = 7 + payload[6]
        key_end = exchange_end + 1 + payload[exchange_end]
        bits = payload[key_end]
        if key_end + 1 != len(payload):
            return None
        exchange = payload[7:exchange_end].decode()
        routing_key = payload[exchange_end + 1 : key_end].decode()
    except (IndexError, UnicodeDecodeError):
        return None
    method = commands.Basic.Publish.__new__(commands.Basic.Publish)
    method.ticket = payload[4] << 8 | payload[5]
    method.exchange = exchange
    method.routing_key = routing_key
    method.mandatory = bool(bits & 1)
    method.immediate = bool(bits & 2)
    return method


def _fast_ack(payload: bytes) -> commands.Basic.Ack | None:
    """basic.ack read straight off the payload, as :func:`_fast_publish`."""
    if len(payload) != 13:
        return None
    delivery_tag, bits = _ACK_ARGS.unpack_from(payload, 4)
    method = commands.Basic.Ack.__new__(commands.Basic.Ack)
    method.delivery_tag = delivery_tag
    method.multiple = bool(bits & 1)
    return method


def _decode(frame_type: int, payload: bytes, max_depth: int) -> InValue:
    if frame_type == FRAME_BODY:
        return payload
    if frame_type == FRAME_HEARTBEAT:
        return Heartbeat()
    if frame_type == FRAME_METHOD:
        if len(payload) < 4:
            raise FrameError("method frame too short")
        index: int = _INDEX.unpack_from(payload)[0]
        fast: MethodFrame | None = None
        if index == _PUBLISH_INDEX:
            fast = _fast_publish(payload)
        elif index == _ACK_INDEX:
            fast = _fast_ack(payload)
        if fast is not None:
            return fast
        cls: type[MethodFrame] | None = commands.INDEX_MAPPING.get(index)
        if cls is None:
            raise FrameError(f"unknown method {index >> 16}.{index & 0xFFFF}")
        try:
            return decode_arguments(cls, payload, 4, max_depth)
        except (FieldError, struct.error, IndexError, ValueError, OverflowError) as e:
            raise FrameError(
                f"cannot decode {cls.name}: {e}",
                reply_code=_SYNTAX_ERROR,
                class_id=index >> 16,
                method_id=index & 0xFFFF,
            ) from e
    if frame_type == FRAME_HEADER:
        if len(payload) < 14:
            raise FrameError("content header frame too short")
        class_id, _, body_size = _CONTENT_HEAD.unpack_from(payload)
        try:
            properties = decode_properties(payload, 12, max_depth)
        except (FieldError, struct.error, IndexError, ValueError, OverflowError) as e:
            raise FrameError(
                f"cannot decode content header: {e}", reply_code=_SYNTAX_ERROR, class_id=class_id
            ) from e
        return ContentHeaderFrame(class_id, body_size, properties, payload[12:])
    raise FrameError(f"unknown frame type {frame_type}")


_CONFIRM = struct.Struct(">BHIHHqBB")


def confirm_frame(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """basic.ack from the server (a publisher confirm), packed directly: one is sent
    per publish or per run of them, and pamqp's generic marshalling cost more than
    the rest of a confirm's encoding. (Nacks are rare: they stay with pamqp.)"""
    return _CONFIRM.pack(
        FRAME_METHOD, channel, 13, _BASIC_CLASS, 80, delivery_tag, 1 if multiple else 0, 0xCE
    )


def method_frame(channel: int, method: MethodFrame) -> bytes:
    return frame.marshal(method, channel)


def _frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    return b"".join((_FRAME_HEAD.pack(frame_type, channel, len(payload)), payload, b"\xce"))


def content_frames(channel: int, raw_properties: bytes, body: bytes, frame_max: int) -> bytes:
    """A content header and body frames, the body split so no frame exceeds
    ``frame_max`` (section 4.2.6.2)."""
    parts = [
        _frame(
            FRAME_HEADER, channel, _CONTENT_HEAD.pack(_BASIC_CLASS, 0, len(body)) + raw_properties
        )
    ]
    chunk = max(1, frame_max - 8) if frame_max else len(body) or 1
    for start in range(0, len(body), chunk):
        parts.append(_frame(FRAME_BODY, channel, body[start : start + chunk]))
    return b"".join(parts)


def _shortstr(value: str) -> bytes:
    data = value.encode()
    if len(data) > 255:
        raise ValueError("short string longer than 255 bytes")
    return bytes((len(data),)) + data


_DELIVER_HEAD = struct.Struct(">HH")
_DELIVER_TAG = struct.Struct(">QB")


def deliver_frames(
    channel: int,
    *,
    consumer_tag: str,
    delivery_tag: int,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    raw_properties: bytes,
    body: bytes,
    frame_max: int,
) -> bytes:
    """basic.deliver with its content, encoded directly: the hot path of consuming."""
    method = b"".join(
        (
            _DELIVER_HEAD.pack(_BASIC_CLASS, 60),
            _shortstr(consumer_tag),
            _DELIVER_TAG.pack(delivery_tag, 1 if redelivered else 0),
            _shortstr(exchange),
            _shortstr(routing_key),
        )
    )
    return _frame(FRAME_METHOD, channel, method) + content_frames(
        channel, raw_properties, body, frame_max
    )


def marshal_properties(properties: commands.Basic.Properties) -> bytes:
    """The property flags and list of ``properties``, as a content header holds them."""
    return properties.marshal()
