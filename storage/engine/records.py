"""Binary encoding of commit-log records and of messages inside them.

Pure functions: bytes in, values out. A record on disk is framed by the commit log
(length and CRC-32C); this module encodes only the payload, whose first byte is the
record kind. All integers are little-endian; strings are UTF-8 with a u32 length.
"""

from __future__ import annotations

import itertools
import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

from polymq.storage.model import BatchEntry, Message

__all__ = [
    "Ack",
    "Dispatch",
    "Kind",
    "Latest",
    "MessageRecord",
    "Meta",
    "OffsetCommit",
    "Pop",
    "Resolve",
    "decode_entry",
    "decode_message",
    "decode_record",
    "encode_entry",
    "encode_message",
    "encode_record",
    "read_message_entry",
]

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
# Fixed parts of the frequent records, packed in one call each (the hot path).
# MESSAGE: kind, flags, store_ms, source, count, due_ms, group_hash, tag_hash,
# len(message_id), len(aux), number of dispatches; then id, aux, dispatches, entry.
_MESSAGE_HEAD = struct.Struct("<BBqqIqIIIII")
_DISPATCH = struct.Struct("<IIq")  # topic id, queue id, offset
# POP: kind, len(group), topic id, queue id, offset, deadline, attempt, seq, first pop.
_POP = struct.Struct("<BIIIqqqqq")
_ACK = struct.Struct("<BIIIq")  # kind, len(group), topic id, queue id, offset; then group


class Kind(IntEnum):
    MESSAGE = 1
    POP = 2
    ACK = 3
    OFFSET_COMMIT = 4
    META = 5
    RESOLVE = 6
    LATEST = 7


class _Writer:
    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, value: int) -> None:
        self.parts.append(_U8.pack(value))

    def u32(self, value: int) -> None:
        self.parts.append(_U32.pack(value))

    def i64(self, value: int) -> None:
        self.parts.append(_I64.pack(value))

    def blob(self, value: bytes) -> None:
        self.parts.append(_U32.pack(len(value)))
        self.parts.append(value)

    def text(self, value: str) -> None:
        self.blob(value.encode())

    def raw(self, value: bytes) -> None:
        self.parts.append(value)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def u8(self) -> int:
        (value,) = _U8.unpack_from(self.buf, self.pos)
        self.pos += 1
        return int(value)

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def i64(self) -> int:
        (value,) = _I64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def blob(self) -> bytes:
        size = self.u32()
        end = self.pos + size
        if end > len(self.buf):
            raise ValueError("length runs past the end of the record")
        value = bytes(self.buf[self.pos : end])
        self.pos = end
        return value

    def text(self) -> str:
        return self.blob().decode()

    def rest(self) -> bytes:
        value = bytes(self.buf[self.pos :])
        self.pos = len(self.buf)
        return value


# -- messages ----------------------------------------------------------------------

# A message: ``u32 flags | u32 body length | u32 property count``, the body, each
# property as (u32 length, UTF-8 name, u32 length, value), then each optional field
# whose bit is set in ``flags``, in the order of _OPTIONAL.
_MESSAGE_FIELDS = struct.Struct("<III")
_BLOB, _TEXT, _INT = 0, 1, 2
_OPTIONAL: tuple[tuple[int, str, int], ...] = tuple(
    (1 << bit, name, kind)
    for bit, (name, kind) in enumerate(
        [
            ("key", _BLOB),
            ("tag", _TEXT),
            ("message_group", _TEXT),
            ("delivery_time_ms", _INT),
            ("expiry_ms", _INT),
            ("content_type", _TEXT),
            ("correlation_id", _BLOB),
            ("reply_to", _TEXT),
            ("producer", _TEXT),
            ("born_timestamp_ms", _INT),
            ("born_host", _TEXT),
        ]
    )
)


def encode_message(message: Message) -> bytes:
    parts: list[bytes] = [b"", message.body]
    pack_u32 = _U32.pack
    for name, value in message.properties:
        encoded = name.encode()
        parts += (pack_u32(len(encoded)), encoded, pack_u32(len(value)), value)
    flags = 0
    for bit, attr, kind in _OPTIONAL:
        value = getattr(message, attr)
        if value is None:
            continue
        flags |= bit
        if kind == _INT:
            parts.append(_I64.pack(value))
        else:
            encoded = value.encode() if kind == _TEXT else value
            parts += (pack_u32(len(encoded)), encoded)
    parts[0] = _MESSAGE_FIELDS.pack(flags, len(message.body), len(message.properties))
    return b"".join(parts)


def _past_end() -> ValueError:
    return ValueError("length runs past the end of the record")


def _read_message(buf: bytes, pos: int) -> tuple[Message, int]:
    """Decode the message at ``pos``; return it and the position after it. ``buf`` is
    ``bytes`` so each field costs one slice (of a memoryview: a view, then a copy);
    the bounds are checked inline since this runs for every field of every message
    handed out."""
    limit = len(buf)
    flags, body_size, property_count = _MESSAGE_FIELDS.unpack_from(buf, pos)
    pos += _MESSAGE_FIELDS.size
    end = pos + body_size
    if end > limit:
        raise _past_end()
    body = buf[pos:end]
    pos = end
    if not flags and not property_count:
        return Message(body=body), pos  # the common case, kept cheap
    unpack_u32 = _U32.unpack_from
    properties = []
    for _ in range(property_count):
        (size,) = unpack_u32(buf, pos)
        start, end = pos + 4, pos + 4 + size
        if end > limit:
            raise _past_end()
        name = buf[start:end].decode()
        (size,) = unpack_u32(buf, end)
        start, pos = end + 4, end + 4 + size
        if pos > limit:
            raise _past_end()
        properties.append((name, buf[start:pos]))
    fields: dict[str, Any] = {}
    for bit, attr, kind in _OPTIONAL:
        if bit > flags:
            break  # no higher bit is set
        if not flags & bit:
            continue
        if kind == _INT:
            (fields[attr],) = _I64.unpack_from(buf, pos)
            pos += 8
        else:
            (size,) = unpack_u32(buf, pos)
            start, pos = pos + 4, pos + 4 + size
            if pos > limit:
                raise _past_end()
            value = buf[start:pos]
            fields[attr] = value.decode() if kind == _TEXT else value
    return Message(body=body, properties=tuple(properties), **fields), pos


def decode_message(data: bytes | memoryview) -> Message:
    message, end = _read_message(bytes(data), 0)
    if end != len(data):
        raise ValueError("trailing bytes after a message")
    return message


# An entry is one message or one batch: u8 shape, then the data. A batch is its format,
# raw bytes and offset count, then (shape _BATCH_WITH_MESSAGES) each message.
_SINGLE, _BATCH_WITH_MESSAGES, _BATCH_RAW_ONLY = 0, 1, 2


def encode_entry(entry: Message | BatchEntry) -> bytes:
    if isinstance(entry, Message):
        return b"\x00" + encode_message(entry)
    w = _Writer()
    w.u8(_BATCH_WITH_MESSAGES if entry.messages else _BATCH_RAW_ONLY)
    w.text(entry.format)
    w.blob(entry.raw)
    w.u32(entry.size)
    for message in entry.messages:
        w.blob(encode_message(message))
    return w.getvalue()


def decode_entry(data: bytes | memoryview, *, messages: bool = True) -> Message | BatchEntry:
    """Decode an entry. ``messages=False`` skips a batch's messages (its ``raw`` is all
    a pass-through reader needs)."""
    if not data:
        raise ValueError("empty entry")
    shape = data[0]
    if shape == _SINGLE:
        message, end = _read_message(bytes(data), 1)
        if end != len(data):
            raise ValueError("trailing bytes after a message entry")
        return message
    if shape not in (_BATCH_WITH_MESSAGES, _BATCH_RAW_ONLY):
        raise ValueError(f"unknown entry shape {shape}")
    r = _Reader(data, 1)
    fmt = r.text()
    raw = r.blob()
    count = r.u32()
    if not messages or shape == _BATCH_RAW_ONLY:
        return BatchEntry(format=fmt, raw=raw, count=count)
    members = bytes(data[r.pos :])  # copied once, not once per field
    pos = 0
    decoded = []
    for _ in range(count):
        (size,) = _U32.unpack_from(members, pos)
        message, end = _read_message(members, pos + 4)
        if end != pos + 4 + size:
            raise ValueError("batch member length does not match its content")
        decoded.append(message)
        pos = end
    return BatchEntry(format=fmt, raw=raw, messages=tuple(decoded))


# -- records -----------------------------------------------------------------------


class Dispatch(NamedTuple):
    """One queue an entry is indexed into, at ``offset`` (``-1`` while the entry is
    held back: delayed or a transaction half). A tuple: a fan-out makes thousands."""

    topic_id: int
    queue_id: int
    offset: int


MESSAGE_SCHEDULED = 1  # held until delivery time
MESSAGE_HALF = 2  # held until the transaction commits
# A compaction's copy of an entry already in its queue (``dispatches`` has its one queue
# and first offset, ``due_ms`` the compaction's id): not applied until the compaction's
# closing "compact" metadata record, so a compaction a crash cut short changes nothing.
MESSAGE_COPY = 4


@dataclass(frozen=True, slots=True)
class MessageRecord:
    """A stored entry. ``source`` is the position of the held record (delayed or
    half) this one makes visible, else -1. ``count`` is how many offsets it spans."""

    flags: int
    store_ms: int
    message_id: str
    source: int
    count: int
    due_ms: int
    group_hash: int
    tag_hash: int
    dispatches: tuple[Dispatch, ...]
    aux: str
    entry: bytes  # encode_entry() output, kept encoded so copies never re-encode


@dataclass(frozen=True, slots=True)
class Pop:
    """A message handed to ``group`` (also a change of invisibility: a new ``seq``)."""

    group: str
    topic_id: int
    queue_id: int
    offset: int
    deadline_ms: int
    attempt: int
    seq: int
    first_pop_ms: int


@dataclass(frozen=True, slots=True)
class Ack:
    group: str
    topic_id: int
    queue_id: int
    offset: int


@dataclass(frozen=True, slots=True)
class OffsetCommit:
    group: str
    topic_id: int
    queue_id: int
    offset: int
    metadata: str
    commit_ms: int


@dataclass(frozen=True, slots=True)
class Meta:
    """A metadata change as a JSON object (rare, small: JSON keeps it readable)."""

    op: dict[str, Any]


RESOLVE_ROLLBACK = 0
RESOLVE_CANCEL = 1


@dataclass(frozen=True, slots=True)
class Resolve:
    """A held record dropped: a transaction rolled back or a delayed message recalled."""

    position: int
    reason: int


@dataclass(frozen=True, slots=True)
class Latest:
    namespace: str
    topic: str
    key: bytes
    message: bytes | None  # encode_message() output, None clears


Record = MessageRecord | Pop | Ack | OffsetCommit | Meta | Resolve | Latest


def encode_record(record: Record) -> bytes:
    # The two records of every pop and ack first, packed without a writer.
    if type(record) is Pop:
        group = record.group.encode()
        return (
            _POP.pack(
                Kind.POP,
                len(group),
                record.topic_id,
                record.queue_id,
                record.offset,
                record.deadline_ms,
                record.attempt,
                record.seq,
                record.first_pop_ms,
            )
            + group
        )
    if type(record) is Ack:
        group = record.group.encode()
        return (
            _ACK.pack(Kind.ACK, len(group), record.topic_id, record.queue_id, record.offset) + group
        )
    w = _Writer()
    match record:
        case MessageRecord():
            message_id, aux = record.message_id.encode(), record.aux.encode()
            w.raw(
                _MESSAGE_HEAD.pack(
                    Kind.MESSAGE,
                    record.flags,
                    record.store_ms,
                    record.source,
                    record.count,
                    record.due_ms,
                    record.group_hash,
                    record.tag_hash,
                    len(message_id),
                    len(aux),
                    len(record.dispatches),
                )
            )
            w.raw(message_id)
            w.raw(aux)
            if record.dispatches:  # one pack call for the whole fan-out
                count = len(record.dispatches)
                w.raw(struct.pack(f"<{'IIq' * count}", *itertools.chain(*record.dispatches)))
            w.raw(record.entry)
        case OffsetCommit():
            w.u8(Kind.OFFSET_COMMIT)
            w.text(record.group)
            w.u32(record.topic_id)
            w.u32(record.queue_id)
            w.i64(record.offset)
            w.text(record.metadata)
            w.i64(record.commit_ms)
        case Meta():
            w.u8(Kind.META)
            w.raw(json.dumps(record.op, separators=(",", ":")).encode())
        case Resolve():
            w.u8(Kind.RESOLVE)
            w.i64(record.position)
            w.u8(record.reason)
        case Latest():
            w.u8(Kind.LATEST)
            w.text(record.namespace)
            w.text(record.topic)
            w.blob(record.key)
            if record.message is None:
                w.u8(0)
            else:
                w.u8(1)
                w.raw(record.message)
    return w.getvalue()


def decode_record(payload: bytes | memoryview) -> Record:
    """Decode one payload. Raises ``ValueError`` (or ``struct.error``) if malformed."""
    r = _Reader(payload)
    kind = r.u8()
    if kind == Kind.MESSAGE:
        (
            _,
            flags,
            store_ms,
            source,
            count,
            due_ms,
            group_hash,
            tag_hash,
            id_len,
            aux_len,
            n_dispatches,
        ) = _MESSAGE_HEAD.unpack_from(payload)
        pos = _MESSAGE_HEAD.size
        message_id = bytes(payload[pos : pos + id_len]).decode()
        pos += id_len
        aux = bytes(payload[pos : pos + aux_len]).decode()
        pos += aux_len
        dispatches = tuple(
            map(
                Dispatch._make,
                _DISPATCH.iter_unpack(
                    memoryview(payload)[pos : pos + n_dispatches * _DISPATCH.size]
                ),
            )
        )
        pos += n_dispatches * _DISPATCH.size
        if pos > len(payload):
            raise ValueError("message record is shorter than its header says")
        return MessageRecord(
            flags,
            store_ms,
            message_id,
            source,
            count,
            due_ms,
            group_hash,
            tag_hash,
            dispatches,
            aux,
            bytes(payload[pos:]),
        )
    if kind == Kind.POP:
        _, group_len, *fields = _POP.unpack_from(payload)
        group = _tail_text(payload, _POP.size, group_len)
        return Pop(group, *fields)
    if kind == Kind.ACK:
        _, group_len, topic_id, queue_id, offset = _ACK.unpack_from(payload)
        return Ack(_tail_text(payload, _ACK.size, group_len), topic_id, queue_id, offset)
    if kind == Kind.OFFSET_COMMIT:
        return OffsetCommit(r.text(), r.u32(), r.u32(), r.i64(), r.text(), r.i64())
    if kind == Kind.META:
        op = json.loads(bytes(r.rest()))
        if not isinstance(op, dict):
            raise ValueError("metadata record is not a JSON object")
        return Meta(op)
    if kind == Kind.RESOLVE:
        return Resolve(r.i64(), r.u8())
    if kind == Kind.LATEST:
        namespace, topic, key = r.text(), r.text(), r.blob()
        return Latest(namespace, topic, key, r.rest() if r.u8() else None)
    raise ValueError(f"unknown record kind {kind}")


def read_message_entry(payload: bytes | memoryview) -> tuple[str, memoryview]:
    """The message id and the encoded entry of a MESSAGE payload, without decoding the
    rest: what a reader needs (the hot path of every read and pop)."""
    head = _MESSAGE_HEAD.unpack_from(payload)
    if head[0] != Kind.MESSAGE:
        raise ValueError(f"record kind {head[0]} is not a message")
    id_len, aux_len, n_dispatches = head[8], head[9], head[10]
    start = _MESSAGE_HEAD.size
    view = memoryview(payload)
    message_id = bytes(view[start : start + id_len]).decode()
    entry_start = start + id_len + aux_len + n_dispatches * _DISPATCH.size
    if entry_start > len(view):
        raise ValueError("message record is shorter than its header says")
    return message_id, view[entry_start:]


def _tail_text(payload: bytes | memoryview, start: int, size: int) -> str:
    if start + size != len(payload):
        raise ValueError("record length does not match its header")
    return bytes(payload[start:]).decode()
