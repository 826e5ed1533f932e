"""Kafka record batches (message format v2), pure: bytes in, records out, and back.

Layout (https://kafka.apache.org/documentation/#recordbatch)::

    baseOffset int64 | batchLength int32 | partitionLeaderEpoch int32 | magic int8 (2)
    | crc uint32 (CRC-32C of attributes onward) | attributes int16 | lastOffsetDelta int32
    | baseTimestamp int64 | maxTimestamp int64 | producerId int64 | producerEpoch int16
    | baseSequence int32 | recordCount int32 | records...

``baseOffset`` and ``batchLength`` lie outside the CRC, so a stored batch is served at
its storage offset by rewriting the first 8 bytes only (:func:`with_base_offset`).
kio's own record reader drops compression and sub-second timestamps, hence this module.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import cramjam
from crc32c import crc32c

from polymq.protocols import interop
from polymq.storage.model import Message

__all__ = [
    "BATCH_FORMAT",
    "BatchHeader",
    "CorruptBatch",
    "KafkaRecord",
    "check_records",
    "encode_batch",
    "encode_control_batch",
    "expand_batch",
    "iter_records",
    "parse_header",
    "with_base_offset",
]

BATCH_FORMAT = "kafka.v2"
HEADER_SIZE = 61
_HEADER = struct.Struct(">qiibIhiqqqhii")
_AFTER_CRC = struct.Struct(">hiqqqhii")  # attributes .. recordCount
_CRC_START = 21  # attributes onward
_COMPRESSION_MASK = 0x07
_TRANSACTIONAL = 0x10
_CONTROL = 0x20

# Message fields Kafka has no slot for travel as headers (protocols/interop.py).
_FIELD_HEADERS = (
    interop.TAG,
    interop.MESSAGE_GROUP,
    interop.CONTENT_TYPE,
    interop.CORRELATION_ID,
    interop.REPLY_TO,
)


class CorruptBatch(ValueError):
    """The bytes are not a well-formed v2 record batch (Kafka's CORRUPT_MESSAGE)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchHeader:
    base_offset: int
    length: int  # whole batch, including the 12 bytes of baseOffset and batchLength
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def compression(self) -> int:
        return self.attributes & _COMPRESSION_MASK

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & _TRANSACTIONAL)

    @property
    def control(self) -> bool:
        return bool(self.attributes & _CONTROL)


@dataclass(frozen=True, slots=True, kw_only=True)
class KafkaRecord:
    offset_delta: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()


def parse_header(data: bytes | memoryview, *, check_crc: bool = True) -> BatchHeader:
    """The header of the batch at the start of ``data``; the CRC is checked."""
    if len(data) < HEADER_SIZE:
        raise CorruptBatch("record batch shorter than its header")
    fields = _HEADER.unpack_from(data, 0)
    header = BatchHeader(
        base_offset=fields[0],
        length=fields[1] + 12,
        leader_epoch=fields[2],
        magic=fields[3],
        crc=fields[4],
        attributes=fields[5],
        last_offset_delta=fields[6],
        base_timestamp=fields[7],
        max_timestamp=fields[8],
        producer_id=fields[9],
        producer_epoch=fields[10],
        base_sequence=fields[11],
        record_count=fields[12],
    )
    if header.magic != 2:
        raise CorruptBatch(f"unsupported record batch magic {header.magic}")
    if header.length < HEADER_SIZE or header.length > len(data):
        raise CorruptBatch("record batch length does not match its bytes")
    if header.record_count < 0 or header.last_offset_delta < 0:
        raise CorruptBatch("negative record count")
    if check_crc and crc32c(memoryview(data)[_CRC_START : header.length]) != header.crc:
        raise CorruptBatch("record batch CRC mismatch")
    return header


def with_base_offset(batch: bytes, base_offset: int) -> bytes:
    """The same batch at another base offset: outside the CRC, so nothing else changes."""
    return struct.pack(">q", base_offset) + batch[8:]


# -- reading records -------------------------------------------------------------------


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """A zig-zag varint (protobuf style, as Kafka records use) and the next position."""
    shift = result = 0
    while True:
        if position >= len(data):
            raise CorruptBatch("record truncated inside a varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), position
        shift += 7
        if shift > 63:
            raise CorruptBatch("varint too long")


def _bytes(data: bytes, position: int) -> tuple[bytes | None, int]:
    length, position = _varint(data, position)
    if length < 0:
        return None, position
    end = position + length
    if end > len(data):
        raise CorruptBatch("record truncated")
    return data[position:end], end


def _decompress(codec: int, data: bytes) -> bytes:
    try:
        if codec == 1:
            return bytes(cramjam.gzip.decompress(data))
        if codec == 2:
            return _snappy(data)
        if codec == 3:
            return bytes(cramjam.lz4.decompress(data))
        if codec == 4:
            return bytes(cramjam.zstd.decompress(data))
    except Exception as e:  # cramjam raises its own error types
        raise CorruptBatch(f"cannot decompress records: {e}") from e
    raise CorruptBatch(f"unknown compression codec {codec}")


_XERIAL_MAGIC = b"\x82SNAPPY\x00"


def _snappy(data: bytes) -> bytes:
    """Java clients frame snappy the xerial way (16-byte header, then int32-sized
    blocks); librdkafka reads both and may write raw snappy."""
    if not data.startswith(_XERIAL_MAGIC):
        return bytes(cramjam.snappy.decompress_raw(data))
    out = bytearray()
    position = 16
    while position < len(data):
        (size,) = struct.unpack_from(">i", data, position)
        position += 4
        out += bytes(cramjam.snappy.decompress_raw(data[position : position + size]))
        position += size
    return bytes(out)


def _records_section(batch: bytes) -> tuple[BatchHeader, bytes]:
    """The batch's header and its records' bytes, decompressed."""
    header = parse_header(batch, check_crc=False)
    body = batch[HEADER_SIZE : header.length]
    if header.compression:
        body = _decompress(header.compression, body)
    return header, body


def iter_records(batch: bytes) -> Iterator[KafkaRecord]:
    """The records of one batch, decompressed."""
    header, body = _records_section(batch)
    position = 0
    for _ in range(header.record_count):
        length, position = _varint(body, position)
        end = position + length
        if length < 0 or end > len(body):
            raise CorruptBatch("record length beyond the batch")
        position += 1  # attributes, unused
        timestamp_delta, position = _varint(body, position)
        offset_delta, position = _varint(body, position)
        key, position = _bytes(body, position)
        value, position = _bytes(body, position)
        count, position = _varint(body, position)
        headers: list[tuple[str, bytes | None]] = []
        for _ in range(count):
            name, position = _bytes(body, position)
            header_value, position = _bytes(body, position)
            headers.append(((name or b"").decode("utf-8", "replace"), header_value))
        if position != end:
            raise CorruptBatch("record length does not match its fields")
        yield KafkaRecord(
            offset_delta=offset_delta,
            timestamp_ms=header.base_timestamp + timestamp_delta,
            key=key,
            value=value,
            headers=tuple(headers),
        )


def record_to_message(record: KafkaRecord) -> Message:
    """A record as the abstract message: key, timestamp and headers per interop.py."""
    fields: dict[str, bytes] = {}
    properties: list[tuple[str, bytes]] = []
    for name, value in record.headers:
        if name in _FIELD_HEADERS and name not in fields:
            fields[name] = value or b""
        else:
            properties.append((name, value or b""))
    tag = fields.get(interop.TAG)
    group = fields.get(interop.MESSAGE_GROUP)
    content_type = fields.get(interop.CONTENT_TYPE)
    reply_to = fields.get(interop.REPLY_TO)
    return Message(
        body=record.value or b"",
        key=record.key,
        tag=tag.decode("utf-8", "replace") if tag is not None else None,
        message_group=group.decode("utf-8", "replace") if group is not None else None,
        content_type=content_type.decode("utf-8", "replace") if content_type else None,
        correlation_id=fields.get(interop.CORRELATION_ID),
        reply_to=reply_to.decode("utf-8", "replace") if reply_to is not None else None,
        properties=tuple(properties),
        born_timestamp_ms=record.timestamp_ms,
    )


CONTROL_PROPERTY = "kafka.control"


CORRUPT_PROPERTY = "kafka.corrupt"


def check_records(batch: bytes) -> None:
    """Raise :class:`CorruptBatch` unless the records decompress and their lengths add
    up to the batch (a cheap walk, not a full parse), so what is stored expands."""
    header, body = _records_section(batch)
    position = 0
    for _ in range(header.record_count):
        length, position = _varint(body, position)
        position += length
        if length <= 0 or position > len(body):
            raise CorruptBatch("record length beyond the batch")
    if position != len(body):
        raise CorruptBatch("bytes left after the last record")


def expand_batch(raw: bytes) -> tuple[Message, ...]:
    """The ``kafka.v2`` expander: a stored batch as single messages, for other protocols.
    A transaction marker becomes an empty message flagged ``kafka.control``. It never
    fails (a failing expander would make the queue unreadable for others): records that
    do not parse become empty messages flagged ``kafka.corrupt``, as many as the batch
    counts."""
    try:
        return _expand(raw)
    except CorruptBatch:
        count = parse_header(raw, check_crc=False).record_count if len(raw) >= HEADER_SIZE else 0
        return tuple(Message(properties=((CORRUPT_PROPERTY, b"1"),)) for _ in range(count))


def _expand(raw: bytes) -> tuple[Message, ...]:
    if parse_header(raw, check_crc=False).control:
        records = list(iter_records(raw))
        kind = b"commit" if records and records[0].key == struct.pack(">hh", 0, 1) else b"abort"
        return tuple(
            Message(properties=((CONTROL_PROPERTY, kind),), born_timestamp_ms=r.timestamp_ms)
            for r in records
        )
    return tuple(record_to_message(record) for record in iter_records(raw))


# -- writing records -------------------------------------------------------------------


def _put_varint(out: bytearray, value: int) -> None:
    value = (value << 1) ^ (value >> 63)
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_bytes(out: bytearray, value: bytes | None) -> None:
    if value is None:
        _put_varint(out, -1)
        return
    _put_varint(out, len(value))
    out += value


def message_headers(message: Message) -> list[tuple[str, bytes]]:
    """A message's fields without a Kafka slot, then its own properties, as headers
    (other protocols' bookkeeping, such as the raw AMQP properties, left out)."""
    headers: list[tuple[str, bytes]] = []
    if message.tag is not None:
        headers.append((interop.TAG, message.tag.encode()))
    if message.message_group is not None:
        headers.append((interop.MESSAGE_GROUP, message.message_group.encode()))
    if message.content_type is not None:
        headers.append((interop.CONTENT_TYPE, message.content_type.encode()))
    if message.correlation_id is not None:
        headers.append((interop.CORRELATION_ID, message.correlation_id))
    if message.reply_to is not None:
        headers.append((interop.REPLY_TO, message.reply_to.encode()))
    headers.extend(p for p in message.properties if not interop.is_private(p[0]))
    return headers


def encode_batch(
    base_offset: int,
    records: Sequence[KafkaRecord],
    *,
    attributes: int = 0,
    producer_id: int = -1,
    producer_epoch: int = -1,
) -> bytes:
    """An uncompressed batch holding ``records`` (offset deltas and timestamps as
    given), with its CRC; non-transactional unless ``attributes`` say otherwise."""
    base_timestamp = min((r.timestamp_ms for r in records), default=0)
    max_timestamp = max((r.timestamp_ms for r in records), default=0)
    body = bytearray()
    for record in records:
        one = bytearray(b"\x00")
        _put_varint(one, record.timestamp_ms - base_timestamp)
        _put_varint(one, record.offset_delta)
        _put_bytes(one, record.key)
        _put_bytes(one, record.value)
        _put_varint(one, len(record.headers))
        for name, value in record.headers:
            _put_bytes(one, name.encode())
            _put_bytes(one, value)
        _put_varint(body, len(one))
        body += one
    last_delta = max((r.offset_delta for r in records), default=0)
    after_crc = (
        _AFTER_CRC.pack(
            attributes,
            last_delta,
            base_timestamp,
            max_timestamp,
            producer_id,
            producer_epoch,
            -1,
            len(records),
        )
        + body
    )
    length = 4 + 1 + 4 + len(after_crc)  # leader epoch, magic, crc, rest
    return struct.pack(">qiibI", base_offset, length, 0, 2, crc32c(after_crc)) + after_crc


def encode_control_batch(
    producer_id: int, producer_epoch: int, *, commit: bool, timestamp_ms: int
) -> bytes:
    """A transaction marker (KIP-98 control record): key = version 0 and type (0 abort,
    1 commit), value = version 0 and the coordinator epoch."""
    record = KafkaRecord(
        offset_delta=0,
        timestamp_ms=timestamp_ms,
        key=struct.pack(">hh", 0, 1 if commit else 0),
        value=struct.pack(">hi", 0, 0),
    )
    return encode_batch(
        0,
        [record],
        attributes=_TRANSACTIONAL | _CONTROL,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
    )
