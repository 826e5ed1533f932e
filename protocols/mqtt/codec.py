"""MQTT 3.1, 3.1.1 and 5.0 packets: bytes in, packets out, packets in, bytes out.

Pure (no sockets, no asyncio), in the shape of h11: feed bytes to a :class:`Decoder`,
take whole packets out; :func:`encode` turns a packet into bytes for a protocol level.

We keep our own codec rather than wrap ``mqtt5`` (0.8.0): that package knows only
MQTT 5 (its ``ConnectPacket`` has no protocol level and it cannot write a 3.1.1
CONNACK or SUBACK), and the three levels share one fixed header, so one small
incremental decoder with a property table serves all of them.

Section numbers refer to the OASIS MQTT 5.0 standard ("v5 x.y") and MQTT 3.1.1
("v3 x.y").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LEVEL_5",
    "LEVEL_31",
    "LEVEL_311",
    "Auth",
    "ConnAck",
    "Connect",
    "Decoder",
    "Disconnect",
    "MalformedPacket",
    "Packet",
    "PacketTooLarge",
    "PingReq",
    "PingResp",
    "ProtocolError",
    "PubAck",
    "PubComp",
    "PubRec",
    "PubRel",
    "Publish",
    "SubAck",
    "Subscribe",
    "Subscription",
    "TooManyFilters",
    "UnsubAck",
    "Unsubscribe",
    "encode",
]

LEVEL_31 = 3  # protocol name "MQIsdp"
LEVEL_311 = 4
LEVEL_5 = 5

# Control packet types (v5 2.1.2).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = (
    8,
    9,
    10,
    11,
    12,
    13,
    14,
    15,
)

# Property identifiers (v5 2.2.2.2), with their wire types.
PAYLOAD_FORMAT = 0x01
MESSAGE_EXPIRY = 0x02
CONTENT_TYPE = 0x03
RESPONSE_TOPIC = 0x08
CORRELATION_DATA = 0x09
SUBSCRIPTION_ID = 0x0B
SESSION_EXPIRY = 0x11
ASSIGNED_CLIENT_ID = 0x12
SERVER_KEEP_ALIVE = 0x13
AUTH_METHOD = 0x15
AUTH_DATA = 0x16
REQUEST_PROBLEM_INFO = 0x17
WILL_DELAY = 0x18
REQUEST_RESPONSE_INFO = 0x19
RESPONSE_INFO = 0x1A
SERVER_REFERENCE = 0x1C
REASON_STRING = 0x1F
RECEIVE_MAXIMUM = 0x21
TOPIC_ALIAS_MAXIMUM = 0x22
TOPIC_ALIAS = 0x23
MAXIMUM_QOS = 0x24
RETAIN_AVAILABLE = 0x25
USER_PROPERTY = 0x26
MAXIMUM_PACKET_SIZE = 0x27
WILDCARD_SUB_AVAILABLE = 0x28
SUB_ID_AVAILABLE = 0x29
SHARED_SUB_AVAILABLE = 0x2A

_BYTE, _INT2, _INT4, _VARINT, _UTF8, _BINARY, _PAIR = range(7)
_PROPERTY_TYPES: dict[int, int] = {
    PAYLOAD_FORMAT: _BYTE,
    MESSAGE_EXPIRY: _INT4,
    CONTENT_TYPE: _UTF8,
    RESPONSE_TOPIC: _UTF8,
    CORRELATION_DATA: _BINARY,
    SUBSCRIPTION_ID: _VARINT,
    SESSION_EXPIRY: _INT4,
    ASSIGNED_CLIENT_ID: _UTF8,
    SERVER_KEEP_ALIVE: _INT2,
    AUTH_METHOD: _UTF8,
    AUTH_DATA: _BINARY,
    REQUEST_PROBLEM_INFO: _BYTE,
    WILL_DELAY: _INT4,
    REQUEST_RESPONSE_INFO: _BYTE,
    RESPONSE_INFO: _UTF8,
    SERVER_REFERENCE: _UTF8,
    REASON_STRING: _UTF8,
    RECEIVE_MAXIMUM: _INT2,
    TOPIC_ALIAS_MAXIMUM: _INT2,
    TOPIC_ALIAS: _INT2,
    MAXIMUM_QOS: _BYTE,
    RETAIN_AVAILABLE: _BYTE,
    USER_PROPERTY: _PAIR,
    MAXIMUM_PACKET_SIZE: _INT4,
    WILDCARD_SUB_AVAILABLE: _BYTE,
    SUB_ID_AVAILABLE: _BYTE,
    SHARED_SUB_AVAILABLE: _BYTE,
}

Properties = dict[int, Any]
"""Property id to value; ``USER_PROPERTY`` holds a list of (name, value) pairs in
order, ``SUBSCRIPTION_ID`` a list of ints (both may repeat, v5 3.3.2.3.7/8)."""

_REPEATABLE = (USER_PROPERTY, SUBSCRIPTION_ID)


class MalformedPacket(Exception):
    """The bytes break the packet grammar (v5 reason 0x81); the connection closes."""

    reason = 0x81


class ProtocolError(Exception):
    """Well-formed bytes the protocol forbids here (v5 reason 0x82)."""

    reason = 0x82


class PacketTooLarge(Exception):
    """Over the server's maximum packet size (v5 reason 0x95, 3.1.2.11.4)."""

    reason = 0x95


class TooManyFilters(ProtocolError):
    """A SUBSCRIBE or UNSUBSCRIBE naming more topic filters than the server takes in
    one packet (v5 reason 0x97, Quota exceeded). Raised once the limit is passed, so
    refusing a packet of 100,000 filters costs no more than reading the allowed ones."""

    reason = 0x97


# -- packets ---------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Connect:
    level: int
    client_id: str
    clean_start: bool = True
    keep_alive: int = 0
    username: str | None = None
    password: bytes | None = None
    will_topic: str | None = None
    will_payload: bytes = b""
    will_qos: int = 0
    will_retain: bool = False
    will_properties: Properties = field(default_factory=dict)
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class ConnAck:
    session_present: bool = False
    reason: int = 0  # v3 return code or v5 reason code
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class Publish:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class _Ack:
    packet_id: int
    reason: int = 0
    properties: Properties = field(default_factory=dict)


class PubAck(_Ack):
    __slots__ = ()


class PubRec(_Ack):
    __slots__ = ()


class PubRel(_Ack):
    __slots__ = ()


class PubComp(_Ack):
    __slots__ = ()


@dataclass(slots=True, kw_only=True, frozen=True)
class Subscription:
    """One topic filter of a SUBSCRIBE with its options (v5 3.8.3.1)."""

    filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True, kw_only=True)
class Subscribe:
    packet_id: int
    subscriptions: list[Subscription]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class SubAck:
    packet_id: int
    reasons: list[int]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class Unsubscribe:
    packet_id: int
    filters: list[str]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class UnsubAck:
    packet_id: int
    reasons: list[int] = field(default_factory=list)
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class PingReq:
    pass


@dataclass(slots=True)
class PingResp:
    pass


@dataclass(slots=True, kw_only=True)
class Disconnect:
    reason: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class Auth:
    reason: int = 0
    properties: Properties = field(default_factory=dict)


Packet = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | PubRec
    | PubRel
    | PubComp
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)

# -- reading primitives (v5 1.5) -------------------------------------------------------


class _Reader:
    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int, end: int) -> None:
        self.data = data
        self.pos = pos
        self.end = end

    def left(self) -> int:
        return self.end - self.pos

    def byte(self) -> int:
        if self.pos >= self.end:
            raise MalformedPacket("packet ends early")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def int2(self) -> int:
        if self.pos + 2 > self.end:
            raise MalformedPacket("packet ends early")
        value: int = struct.unpack_from(">H", self.data, self.pos)[0]
        self.pos += 2
        return value

    def int4(self) -> int:
        if self.pos + 4 > self.end:
            raise MalformedPacket("packet ends early")
        value: int = struct.unpack_from(">I", self.data, self.pos)[0]
        self.pos += 4
        return value

    def varint(self) -> int:
        """Variable Byte Integer (v5 1.5.5): at most four bytes."""
        value = 0
        for shift in (0, 7, 14, 21):
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
        raise MalformedPacket("variable byte integer longer than four bytes")

    def binary(self) -> bytes:
        """Binary Data (v5 1.5.6): two-byte length, then the bytes."""
        n = self.int2()
        if self.pos + n > self.end:
            raise MalformedPacket("string or binary data runs past the packet")
        value = self.data[self.pos : self.pos + n]
        self.pos += n
        return bytes(value)

    def utf8(self) -> str:
        """UTF-8 Encoded String (v5 1.5.4): well-formed UTF-8 without U+0000."""
        raw = self.binary()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedPacket(f"invalid UTF-8 string: {e}") from None
        if "\x00" in text:
            raise MalformedPacket("UTF-8 string contains U+0000")
        return text

    def rest(self) -> bytes:
        value = bytes(self.data[self.pos : self.end])
        self.pos = self.end
        return value

    def properties(self) -> Properties:
        """A property block (v5 2.2.2): its length, then id/value pairs."""
        length = self.varint()
        end = self.pos + length
        if end > self.end:
            raise MalformedPacket("properties run past the packet")
        props: Properties = {}
        while self.pos < end:
            pid = self.varint()
            kind = _PROPERTY_TYPES.get(pid)
            if kind is None:
                raise MalformedPacket(f"unknown property 0x{pid:02x}")
            value: Any
            if kind == _BYTE:
                value = self.byte()
            elif kind == _INT2:
                value = self.int2()
            elif kind == _INT4:
                value = self.int4()
            elif kind == _VARINT:
                value = self.varint()
            elif kind == _UTF8:
                value = self.utf8()
            elif kind == _BINARY:
                value = self.binary()
            else:
                value = (self.utf8(), self.utf8())
            if pid in _REPEATABLE:
                props.setdefault(pid, []).append(value)
            elif pid in props:
                raise ProtocolError(f"property 0x{pid:02x} given twice")
            else:
                props[pid] = value
        if self.pos != end:
            raise MalformedPacket("property block length mismatch")
        return props


# -- decoding --------------------------------------------------------------------------


class Decoder:
    """Incremental decoder: :meth:`feed` bytes, get the whole packets they complete.

    ``level`` is the protocol level the packets after CONNECT are read at; it starts
    unknown and is set from the CONNECT packet (or by the caller, for a client-side
    decoder). ``max_packet_bytes`` bounds a whole packet (fixed header included) and
    is checked from the fixed header alone, before the body is buffered.
    ``max_filters`` bounds the topic filters of one SUBSCRIBE or UNSUBSCRIBE.

    With ``stop_after_connect`` (a server's decoder), :meth:`feed` returns right after
    a CONNECT and leaves what follows buffered: the CONNECT decides how the rest is
    read (the larger packet limit a logged-in client gets), so the caller adjusts the
    decoder, then calls ``feed(b"")``.
    """

    # Slots: a server holds one per connection, most of them idle.
    __slots__ = (
        "_buffer",
        "_declared",
        "_stop_after_connect",
        "level",
        "max_filters",
        "max_packet_bytes",
    )

    def __init__(
        self,
        *,
        level: int | None = None,
        max_packet_bytes: int = 1 << 28,
        max_filters: int | None = None,
        stop_after_connect: bool = False,
    ) -> None:
        self.level = level
        self.max_packet_bytes = max_packet_bytes
        self.max_filters = max_filters
        self._stop_after_connect = stop_after_connect
        # What a feed left of a packet begun; None when nothing is (a connection
        # that waits between packets holds no buffer, and a feed of whole packets
        # decodes them from its own bytes, not from a copy).
        self._buffer: bytearray | None = None
        self._declared = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes of a packet begun but not yet whole."""
        return len(self._buffer) if self._buffer is not None else 0

    @property
    def declared_size(self) -> int:
        """The whole size of the packet begun, once its fixed header is in; else 0.
        What a reader reserves while the rest of the packet arrives."""
        return self._declared

    def feed(self, data: bytes) -> list[Packet]:
        buf: bytes | bytearray
        if self._buffer is not None:
            self._buffer += data
            buf = self._buffer
        else:
            buf = data
        self._declared = 0
        packets: list[Packet] = []
        pos = 0
        size = len(buf)
        while size - pos >= 2:
            # Fixed header (v5 2.1.1, 2.1.4): type/flags byte, remaining length.
            length = 0
            header = 1
            for shift in (0, 7, 14, 21):
                if pos + header >= size:
                    length = -1
                    break
                byte = buf[pos + header]
                header += 1
                length |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
            else:
                raise MalformedPacket("remaining length longer than four bytes")
            if length < 0:
                break
            if header + length > self.max_packet_bytes:
                raise PacketTooLarge(
                    f"packet of {header + length} bytes is over {self.max_packet_bytes}"
                )
            if pos + header + length > size:
                self._declared = header + length
                break
            first = buf[pos]
            body = bytes(buf[pos + header : pos + header + length])
            pos += header + length
            packet = self._decode(first >> 4, first & 0x0F, body)
            packets.append(packet)
            if isinstance(packet, Connect):
                self.level = packet.level
                if self._stop_after_connect:
                    break
        if pos == size:
            self._buffer = None
        elif self._buffer is None:  # decoded from ``data``: keep what is left of it
            self._buffer = bytearray(data[pos:] if pos else data)
        elif pos:
            del self._buffer[:pos]
        return packets

    def _decode(self, kind: int, flags: int, body: bytes) -> Packet:
        v5 = self.level == LEVEL_5
        if kind == PUBLISH and not v5:  # the common packet, without a reader object
            return _decode_publish_v3(body, flags)
        r = _Reader(body, 0, len(body))
        packet: Packet
        if kind == PUBLISH:
            packet = _decode_publish(r, flags, v5)
        elif kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
            # v5 3.6.1: PUBREL's fixed header flags are 0010, the others' 0000.
            if flags != (0b0010 if kind == PUBREL else 0):
                raise MalformedPacket("bad fixed header flags")
            packet = _ACK_TYPES[kind](packet_id=r.int2())
            if v5 and r.left():
                packet.reason = r.byte()
                if r.left():
                    packet.properties = r.properties()
        elif kind == CONNECT:
            if flags:
                raise MalformedPacket("bad fixed header flags")
            packet = _decode_connect(r)
        elif kind == SUBSCRIBE:
            if flags != 0b0010:
                raise MalformedPacket("bad fixed header flags")
            packet = _decode_subscribe(r, v5, self.max_filters)
        elif kind == UNSUBSCRIBE:
            if flags != 0b0010:
                raise MalformedPacket("bad fixed header flags")
            pid = r.int2()
            props = r.properties() if v5 else {}
            filters: list[str] = []
            while r.left():
                if len(filters) == self.max_filters:
                    raise TooManyFilters(f"UNSUBSCRIBE with more than {self.max_filters} filters")
                filters.append(r.utf8())
            if not filters:
                raise ProtocolError("UNSUBSCRIBE without a topic filter (v5 3.10.3)")
            packet = Unsubscribe(packet_id=pid, filters=filters, properties=props)
        elif kind in (PINGREQ, PINGRESP):
            if flags:
                raise MalformedPacket("bad fixed header flags")
            packet = PingReq() if kind == PINGREQ else PingResp()
        elif kind == DISCONNECT:
            packet = Disconnect()
            if v5 and r.left():
                packet.reason = r.byte()
                if r.left():
                    packet.properties = r.properties()
        elif kind == CONNACK:
            packet = ConnAck(session_present=bool(r.byte() & 1), reason=r.byte())
            if v5 and r.left():
                packet.properties = r.properties()
        elif kind == SUBACK:
            pid = r.int2()
            props = r.properties() if v5 else {}
            packet = SubAck(packet_id=pid, reasons=list(r.rest()), properties=props)
        elif kind == UNSUBACK:
            pid = r.int2()
            props = r.properties() if v5 and r.left() else {}
            packet = UnsubAck(packet_id=pid, reasons=list(r.rest()), properties=props)
        elif kind == AUTH and v5:
            packet = Auth()
            if r.left():
                packet.reason = r.byte()
                packet.properties = r.properties()
        else:
            raise MalformedPacket(f"unknown packet type {kind}")
        if r.left():
            raise MalformedPacket("trailing bytes after packet")
        return packet


_ACK_TYPES: dict[int, type[PubAck | PubRec | PubRel | PubComp]] = {
    PUBACK: PubAck,
    PUBREC: PubRec,
    PUBREL: PubRel,
    PUBCOMP: PubComp,
}
_ACK_KINDS: dict[type[_Ack], int] = {cls: kind for kind, cls in _ACK_TYPES.items()}

_PROTOCOL_NAMES = {b"MQTT": (LEVEL_311, LEVEL_5), b"MQIsdp": (LEVEL_31,)}


def _decode_connect(r: _Reader) -> Connect:
    """CONNECT (v5 3.1, v3 3.1)."""
    name = r.binary()
    level = r.byte()
    if level not in _PROTOCOL_NAMES.get(name, ()):
        raise UnsupportedProtocol(name, level)
    flags = r.byte()
    if flags & 0x01:
        raise MalformedPacket("CONNECT reserved flag is set (3.1.2.3)")
    will = bool(flags & 0x04)
    will_qos = (flags >> 3) & 0x03
    if will_qos == 3 or (not will and (will_qos or flags & 0x20)):
        raise MalformedPacket("bad will flags in CONNECT (3.1.2.5-7)")
    keep_alive = r.int2()
    v5 = level == LEVEL_5
    props = r.properties() if v5 else {}
    packet = Connect(
        level=level,
        client_id=r.utf8(),
        clean_start=bool(flags & 0x02),
        keep_alive=keep_alive,
        properties=props,
    )
    if will:
        packet.will_properties = r.properties() if v5 else {}
        packet.will_topic = r.utf8()
        packet.will_payload = r.binary()
        packet.will_qos = will_qos
        packet.will_retain = bool(flags & 0x20)
    if flags & 0x80:
        packet.username = r.utf8()
    if flags & 0x40:
        packet.password = r.binary()
    return packet


class UnsupportedProtocol(MalformedPacket):
    """A CONNECT naming a protocol or level we do not speak: answered with CONNACK
    0x01 (v3) / 0x84 (v5) before closing (v5 3.1.2.2)."""

    reason = 0x84

    def __init__(self, name: bytes, level: int) -> None:
        super().__init__(f"unsupported protocol {name!r} level {level}")
        self.level = level


def _decode_publish(r: _Reader, flags: int, v5: bool) -> Publish:
    """PUBLISH (v5 3.3): QoS 3 is malformed, and so is DUP on QoS 0 (3.3.1.1)."""
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")
    dup = bool(flags & 0x08)
    if dup and not qos:
        raise MalformedPacket("DUP set on a QoS 0 PUBLISH")
    topic = r.utf8()
    pid = 0
    if qos:
        pid = r.int2()
        if not pid:
            raise MalformedPacket("packet identifier 0")
    props = r.properties() if v5 else {}
    return Publish(
        topic=topic,
        payload=r.rest(),
        qos=qos,
        retain=bool(flags & 0x01),
        dup=dup,
        packet_id=pid,
        properties=props,
    )


def _decode_publish_v3(body: bytes, flags: int) -> Publish:
    """:func:`_decode_publish` at levels 3 and 4 (no properties), the same checks
    and errors, read straight from the bytes."""
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")
    dup = bool(flags & 0x08)
    if dup and not qos:
        raise MalformedPacket("DUP set on a QoS 0 PUBLISH")
    size = len(body)
    if size < 2:
        raise MalformedPacket("packet ends early")
    end = 2 + ((body[0] << 8) | body[1])
    if end > size:
        raise MalformedPacket("string or binary data runs past the packet")
    try:
        topic = body[2:end].decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedPacket(f"invalid UTF-8 string: {e}") from None
    if "\x00" in topic:
        raise MalformedPacket("UTF-8 string contains U+0000")
    pid = 0
    if qos:
        if end + 2 > size:
            raise MalformedPacket("packet ends early")
        pid = (body[end] << 8) | body[end + 1]
        if not pid:
            raise MalformedPacket("packet identifier 0")
        end += 2
    return Publish(
        topic=topic,
        payload=body[end:],
        qos=qos,
        retain=bool(flags & 0x01),
        dup=dup,
        packet_id=pid,
        properties={},
    )


def _decode_subscribe(r: _Reader, v5: bool, max_filters: int | None) -> Subscribe:
    """SUBSCRIBE (v5 3.8): options byte bits 0-1 QoS, 2 no local, 3 retain as
    published, 4-5 retain handling, 6-7 reserved (and v3 uses only bits 0-1)."""
    pid = r.int2()
    props = r.properties() if v5 else {}
    subs: list[Subscription] = []
    while r.left():
        if len(subs) == max_filters:
            raise TooManyFilters(f"SUBSCRIBE with more than {max_filters} filters")
        topic_filter = r.utf8()
        options = r.byte()
        qos = options & 0x03
        handling = (options >> 4) & 0x03
        if qos == 3 or handling == 3 or options & 0xC0 or (not v5 and options & 0xFC):
            raise MalformedPacket("bad subscription options")
        subs.append(
            Subscription(
                filter=topic_filter,
                qos=qos,
                no_local=bool(options & 0x04),
                retain_as_published=bool(options & 0x08),
                retain_handling=handling,
            )
        )
    if not subs:
        raise ProtocolError("SUBSCRIBE without a topic filter (v5 3.8.3)")
    return Subscribe(packet_id=pid, subscriptions=subs, properties=props)


# -- encoding --------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack(">H", len(raw)) + raw


def _bin(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def _encode_properties(props: Properties) -> bytes:
    out = bytearray()
    for pid, value in props.items():
        kind = _PROPERTY_TYPES[pid]
        values = value if pid in _REPEATABLE else (value,)
        for item in values:
            out += _varint(pid)
            if kind == _BYTE:
                out.append(item)
            elif kind == _INT2:
                out += struct.pack(">H", item)
            elif kind == _INT4:
                out += struct.pack(">I", item)
            elif kind == _VARINT:
                out += _varint(item)
            elif kind == _UTF8:
                out += _str(item)
            elif kind == _BINARY:
                out += _bin(item)
            else:
                out += _str(item[0]) + _str(item[1])
    return _varint(len(out)) + bytes(out)


def _frame(first: int, body: bytes) -> bytes:
    return bytes((first,)) + _varint(len(body)) + body


def encode_publish_v3(
    topic: bytes, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int
) -> bytes:
    """A PUBLISH at levels 3 and 4 (no properties), ``topic`` encoded already: what
    :func:`encode` makes of the same ``Publish``, for the delivery path, which sends
    one per message and subscriber and needs no ``Publish`` object for it."""
    first = 0x30 | (qos << 1) | (8 if dup else 0) | (1 if retain else 0)
    size = 2 + len(topic) + (2 if qos else 0) + len(payload)
    if size < 128:
        head = bytes((first, size, len(topic) >> 8, len(topic) & 0xFF))
    else:
        head = bytes((first,)) + _varint(size) + bytes((len(topic) >> 8, len(topic) & 0xFF))
    if qos:
        return b"".join((head, topic, bytes((packet_id >> 8, packet_id & 0xFF)), payload))
    return b"".join((head, topic, payload))


def encode(packet: Packet, level: int) -> bytes:
    """The bytes of ``packet`` at protocol ``level``; v5-only fields are left out at
    levels 3 and 4."""
    v5 = level == LEVEL_5
    if isinstance(packet, Publish):
        first = (PUBLISH << 4) | (packet.qos << 1) | (8 if packet.dup else 0) | packet.retain
        body = _str(packet.topic)
        if packet.qos:
            body += struct.pack(">H", packet.packet_id)
        if v5:
            body += _encode_properties(packet.properties)
        return _frame(first, body + packet.payload)
    if isinstance(packet, _Ack):
        kind = _ACK_KINDS[type(packet)]
        body = struct.pack(">H", packet.packet_id)
        if v5 and (packet.reason or packet.properties):
            body += bytes((packet.reason,))
            if packet.properties:
                body += _encode_properties(packet.properties)
        return _frame((kind << 4) | (0b0010 if kind == PUBREL else 0), body)
    if isinstance(packet, ConnAck):
        body = bytes((int(packet.session_present), packet.reason))
        if v5:
            body += _encode_properties(packet.properties)
        return _frame(CONNACK << 4, body)
    if isinstance(packet, SubAck):
        body = struct.pack(">H", packet.packet_id)
        if v5:
            body += _encode_properties(packet.properties)
        return _frame(SUBACK << 4, body + bytes(packet.reasons))
    if isinstance(packet, UnsubAck):
        body = struct.pack(">H", packet.packet_id)
        if v5:
            body += _encode_properties(packet.properties) + bytes(packet.reasons)
        return _frame(UNSUBACK << 4, body)
    if isinstance(packet, PingResp):
        return bytes((PINGRESP << 4, 0))
    if isinstance(packet, PingReq):
        return bytes((PINGREQ << 4, 0))
    if isinstance(packet, Disconnect):
        body = b""
        if v5 and (packet.reason or packet.properties):
            body = bytes((packet.reason,)) + _encode_properties(packet.properties)
        return _frame(DISCONNECT << 4, body)
    if isinstance(packet, Subscribe):
        out = bytearray(struct.pack(">H", packet.packet_id))  # not bytes: linear, not n²
        if v5:
            out += _encode_properties(packet.properties)
        for sub in packet.subscriptions:
            options = sub.qos
            if v5:
                options |= (
                    (sub.no_local << 2)
                    | (sub.retain_as_published << 3)
                    | (sub.retain_handling << 4)
                )
            out += _str(sub.filter)
            out.append(options)
        return _frame((SUBSCRIBE << 4) | 0b0010, bytes(out))
    if isinstance(packet, Unsubscribe):
        body = struct.pack(">H", packet.packet_id)
        if v5:
            body += _encode_properties(packet.properties)
        body += b"".join(_str(f) for f in packet.filters)
        return _frame((UNSUBSCRIBE << 4) | 0b0010, body)
    if isinstance(packet, Connect):
        return _encode_connect(packet)
    if isinstance(packet, Auth):
        body = bytes((packet.reason,)) + _encode_properties(packet.properties)
        return _frame(AUTH << 4, body)
    raise TypeError(f"cannot encode {type(packet).__name__}")


def _encode_connect(packet: Connect) -> bytes:
    v5 = packet.level == LEVEL_5
    name = b"MQIsdp" if packet.level == LEVEL_31 else b"MQTT"
    flags = (
        (0x80 if packet.username is not None else 0)
        | (0x40 if packet.password is not None else 0)
        | (0x02 if packet.clean_start else 0)
    )
    if packet.will_topic is not None:
        flags |= 0x04 | (packet.will_qos << 3) | (0x20 if packet.will_retain else 0)
    body = _bin(name) + bytes((packet.level, flags)) + struct.pack(">H", packet.keep_alive)
    if v5:
        body += _encode_properties(packet.properties)
    body += _str(packet.client_id)
    if packet.will_topic is not None:
        if v5:
            body += _encode_properties(packet.will_properties)
        body += _str(packet.will_topic) + _bin(packet.will_payload)
    if packet.username is not None:
        body += _str(packet.username)
    if packet.password is not None:
        body += _bin(packet.password)
    return _frame(CONNECT << 4, body)
