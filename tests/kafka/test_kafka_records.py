"""The record batch codec, pure: round trips, the CRC, compression and the expander."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

import cramjam
import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

import polymq.protocols.kafka  # noqa: F401  (registers the expander)
from polymq.protocols import interop
from polymq.protocols.kafka.records import (
    CORRUPT_PROPERTY,
    HEADER_SIZE,
    CorruptBatch,
    KafkaRecord,
    check_records,
    encode_batch,
    expand_batch,
    iter_records,
    parse_header,
    record_to_message,
    with_base_offset,
)
from polymq.storage import batch_formats
from tests.kafka.raw import batch_with_body

records_strategy = st.lists(
    st.builds(
        KafkaRecord,
        offset_delta=st.just(0),
        timestamp_ms=st.integers(0, 2**40),
        key=st.none() | st.binary(max_size=20),
        value=st.none() | st.binary(max_size=200),
        headers=st.lists(
            st.tuples(st.text(max_size=10), st.none() | st.binary(max_size=10)), max_size=3
        ).map(tuple),
    ),
    min_size=1,
    max_size=20,
).map(lambda rs: [dataclasses.replace(r, offset_delta=i) for i, r in enumerate(rs)])


@given(records_strategy, st.integers(0, 2**40))
def test_encode_then_read_gives_the_records_back(records: list[KafkaRecord], base: int) -> None:
    batch = encode_batch(base, records)
    header = parse_header(batch)
    assert header.base_offset == base
    assert header.record_count == len(records)
    assert header.last_offset_delta == len(records) - 1
    assert header.length == len(batch)
    assert list(iter_records(batch)) == records


def test_base_offset_is_rewritten_without_breaking_the_crc() -> None:
    batch = encode_batch(0, [KafkaRecord(offset_delta=0, timestamp_ms=5, key=b"k", value=b"v")])
    moved = with_base_offset(batch, 12345)
    assert parse_header(moved).base_offset == 12345
    assert moved[8:] == batch[8:]


def test_a_flipped_bit_fails_the_crc() -> None:
    batch = bytearray(
        encode_batch(0, [KafkaRecord(offset_delta=0, timestamp_ms=1, key=None, value=b"x")])
    )
    batch[-1] ^= 1
    with pytest.raises(CorruptBatch, match="CRC"):
        parse_header(bytes(batch))


def test_truncated_and_wrong_magic_are_corrupt() -> None:
    batch = encode_batch(0, [KafkaRecord(offset_delta=0, timestamp_ms=1, key=None, value=b"x")])
    with pytest.raises(CorruptBatch):
        parse_header(batch[: HEADER_SIZE - 1])
    with pytest.raises(CorruptBatch):
        parse_header(batch[:-1])
    wrong_magic = batch[:16] + b"\x01" + batch[17:]
    with pytest.raises(CorruptBatch, match="magic"):
        parse_header(wrong_magic)


def _compressed(codec: int) -> bytes:
    """A batch whose records section is ``compress``ed with ``codec``."""
    plain = encode_batch(
        7,
        [
            KafkaRecord(offset_delta=i, timestamp_ms=100 + i, key=b"k", value=b"v%d" % i)
            for i in range(3)
        ],
    )
    records = plain[HEADER_SIZE:]
    compressors: dict[int, Callable[[bytes], object]] = {
        1: cramjam.gzip.compress,
        2: cramjam.snappy.compress_raw,
        3: cramjam.lz4.compress,
        4: cramjam.zstd.compress,
    }
    body = bytes(compressors[codec](records))  # type: ignore[call-overload]
    head = bytearray(plain[:HEADER_SIZE])
    struct.pack_into(">h", head, 21, codec)
    batch = bytes(head) + body
    out = bytearray(batch)
    struct.pack_into(">i", out, 8, len(batch) - 12)
    struct.pack_into(">I", out, 17, crc32c(bytes(out[21:])))
    return bytes(out)


@pytest.mark.parametrize("codec", [1, 2, 3, 4], ids=["gzip", "snappy", "lz4", "zstd"])
def test_compressed_batches_expand(codec: int) -> None:
    batch = _compressed(codec)
    assert parse_header(batch).compression == codec
    messages = batch_formats.expand("kafka.v2", batch)
    assert [m.body for m in messages] == [b"v0", b"v1", b"v2"]
    assert [m.born_timestamp_ms for m in messages] == [100, 101, 102]


def test_interop_headers_become_message_fields() -> None:
    record = KafkaRecord(
        offset_delta=0,
        timestamp_ms=9,
        key=b"key",
        value=b"body",
        headers=(
            (interop.TAG, b"tag-a"),
            (interop.CONTENT_TYPE, b"text/plain"),
            (interop.CORRELATION_ID, b"c1"),
            ("user", b"u"),
        ),
    )
    message = record_to_message(record)
    assert message.key == b"key"
    assert message.tag == "tag-a"
    assert message.content_type == "text/plain"
    assert message.correlation_id == b"c1"
    assert message.properties == (("user", b"u"),)
    assert expand_batch(encode_batch(0, [record])) == (message,)


@pytest.mark.parametrize(
    ("codec", "body", "count"),
    [(4, b"not zstd at all", 1), (0, b"\x0a\x00", 1), (0, b"", 2)],
    ids=["undecompressable", "truncated-record", "missing-records"],
)
def test_bad_records_behind_a_good_crc(codec: int, body: bytes, count: int) -> None:
    batch = batch_with_body(codec, body, count)
    parse_header(batch)  # the CRC is fine...
    with pytest.raises(CorruptBatch):
        check_records(batch)  # ...the records are not
    # Should such a batch ever be stored, other protocols still read `count` messages.
    assert [m.property(CORRUPT_PROPERTY) for m in expand_batch(batch)] == [b"1"] * count


def test_expander_never_fails_on_records_that_do_not_parse() -> None:
    batch = batch_with_body(0, b"\x02\x00", 1)  # one record of one byte: lengths add up
    check_records(batch)
    assert [m.property(CORRUPT_PROPERTY) for m in expand_batch(batch)] == [b"1"]
