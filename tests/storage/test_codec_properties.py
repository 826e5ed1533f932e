"""Property tests of the commit-log record codec (storage/engine/records.py).

Round trips for every value the model allows, and robustness of the decoders: any
byte string either decodes or fails with the codec's documented errors (ValueError,
which covers UnicodeDecodeError and json.JSONDecodeError, or struct.error), quickly.
"""

from __future__ import annotations

import contextlib
import struct
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polymq.storage.engine import records as rec
from polymq.storage.model import BatchEntry, Message

I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
U32 = st.integers(min_value=0, max_value=2**32 - 1)
U8 = st.integers(min_value=0, max_value=255)
TEXT = st.text(max_size=24)  # any unicode except lone surrogates (not UTF-8 encodable)
BLOB = st.binary(max_size=64)

# A few fixed names make repeated property names likely (MQTT user properties repeat).
PROPERTY_NAMES = st.sampled_from(["a", "b", "", "ключ", "x y", "\u00e9\u0301"]) | TEXT
PROPERTIES = st.lists(st.tuples(PROPERTY_NAMES, BLOB), max_size=6).map(tuple)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


MESSAGES: st.SearchStrategy[Message] = st.builds(
    Message,
    body=st.binary(max_size=300),
    key=optional(BLOB),
    tag=optional(TEXT),
    properties=PROPERTIES,
    message_group=optional(TEXT),
    delivery_time_ms=optional(I64),
    expiry_ms=optional(I64),
    content_type=optional(TEXT),
    correlation_id=optional(BLOB),
    reply_to=optional(TEXT),
    producer=optional(TEXT),
    born_timestamp_ms=optional(I64),
    born_host=optional(TEXT),
)

BATCHES: st.SearchStrategy[BatchEntry] = st.builds(
    BatchEntry,
    format=TEXT,
    raw=st.binary(max_size=300),
    messages=st.lists(MESSAGES, min_size=1, max_size=5).map(tuple),
) | st.builds(  # raw only: readers expand it with the format's registered expander
    BatchEntry,
    format=TEXT,
    raw=st.binary(max_size=300),
    count=st.integers(min_value=0, max_value=2**32 - 1),
)

ENTRIES: st.SearchStrategy[Message | BatchEntry] = MESSAGES | BATCHES

JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)

MESSAGE_RECORDS: st.SearchStrategy[rec.MessageRecord] = st.builds(
    rec.MessageRecord,
    flags=U8,
    store_ms=I64,
    message_id=TEXT,
    source=I64,
    count=U32,
    due_ms=I64,
    group_hash=U32,
    tag_hash=U32,
    dispatches=st.lists(st.builds(rec.Dispatch, U32, U32, I64), max_size=5).map(tuple),
    aux=TEXT,
    entry=ENTRIES.map(rec.encode_entry) | BLOB,
)

RECORDS: st.SearchStrategy[rec.Record] = st.one_of(
    MESSAGE_RECORDS,
    st.builds(rec.Pop, TEXT, U32, U32, I64, I64, I64, I64, I64),
    st.builds(rec.Ack, TEXT, U32, U32, I64),
    st.builds(rec.OffsetCommit, TEXT, U32, U32, I64, TEXT, I64),
    st.builds(rec.Meta, st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=5)),
    st.builds(rec.Resolve, I64, U8),
    st.builds(rec.Latest, TEXT, TEXT, BLOB, optional(MESSAGES.map(rec.encode_message) | BLOB)),
)

DECODE_ERRORS = (ValueError, struct.error)  # ValueError covers Unicode and JSON errors

GARBAGE_SETTINGS = settings(
    max_examples=300,
    deadline=timedelta(seconds=1),  # "never hangs": one decode must be quick
    suppress_health_check=[HealthCheck.too_slow],
)


# -- round trips -----------------------------------------------------------------------


@settings(max_examples=200)
@given(MESSAGES)
def test_message_round_trip(message: Message) -> None:
    data = rec.encode_message(message)
    assert rec.decode_message(data) == message
    assert rec.decode_message(memoryview(data)) == message
    # Encoding is a pure function of the value.
    assert rec.encode_message(rec.decode_message(data)) == data


@settings(max_examples=200)
@given(MESSAGES)
def test_repeated_property_names_keep_order(message: Message) -> None:
    decoded = rec.decode_message(rec.encode_message(message))
    assert decoded.properties == message.properties
    for name, _ in message.properties:
        assert decoded.property(name) == message.property(name)


@settings(max_examples=200)
@given(ENTRIES)
def test_entry_round_trip(entry: Message | BatchEntry) -> None:
    data = rec.encode_entry(entry)
    decoded = rec.decode_entry(data)
    assert type(decoded) is type(entry)
    assert decoded == entry
    assert rec.decode_entry(memoryview(data)) == entry


@settings(max_examples=200)
@given(ENTRIES)
def test_entry_without_messages_keeps_raw_and_count(entry: Message | BatchEntry) -> None:
    """``messages=False`` is what pass-through readers use: raw bytes and the count."""
    decoded = rec.decode_entry(rec.encode_entry(entry), messages=False)
    if isinstance(entry, Message):
        assert decoded == entry
    else:
        assert decoded == BatchEntry(format=entry.format, raw=entry.raw, count=entry.size)
        assert decoded.size == entry.size


@settings(max_examples=200)
@given(MESSAGE_RECORDS)
def test_read_message_entry_slices_id_and_entry(record: rec.MessageRecord) -> None:
    message_id, entry = rec.read_message_entry(rec.encode_record(record))
    assert message_id == record.message_id
    assert bytes(entry) == record.entry


@settings(max_examples=300)
@given(RECORDS)
def test_record_round_trip(record: rec.Record) -> None:
    payload = rec.encode_record(record)
    decoded = rec.decode_record(payload)
    assert type(decoded) is type(record)
    assert decoded == record
    assert rec.decode_record(memoryview(payload)) == record


# -- truncation and garbage ------------------------------------------------------------


@settings(max_examples=150)
@given(ENTRIES, st.data())
def test_every_strict_prefix_of_an_entry_fails(
    entry: Message | BatchEntry, data: st.DataObject
) -> None:
    """Messages and entries are self-delimiting: a cut one never decodes silently."""
    encoded = rec.encode_entry(entry)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1), label="cut")
    try:
        decoded = rec.decode_entry(encoded[:cut])
    except DECODE_ERRORS:
        return
    raise AssertionError(f"a {cut}-byte prefix of {len(encoded)} bytes decoded: {decoded!r}")


@settings(max_examples=150)
@given(MESSAGES, st.data())
def test_every_strict_prefix_of_a_message_fails(message: Message, data: st.DataObject) -> None:
    encoded = rec.encode_message(message)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1), label="cut")
    try:
        decoded = rec.decode_message(encoded[:cut])
    except DECODE_ERRORS:
        return
    raise AssertionError(f"a {cut}-byte prefix of {len(encoded)} bytes decoded: {decoded!r}")


def _decodes_or_fails_cleanly(data: bytes) -> None:
    for decode in (rec.decode_message, rec.decode_entry, rec.decode_record):
        with contextlib.suppress(*DECODE_ERRORS):
            decode(data)
    with contextlib.suppress(*DECODE_ERRORS):
        rec.decode_entry(data, messages=False)
    with contextlib.suppress(*DECODE_ERRORS):
        rec.read_message_entry(data)


@GARBAGE_SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_fail_cleanly(data: bytes) -> None:
    _decodes_or_fails_cleanly(data)


@GARBAGE_SETTINGS
@given(st.sampled_from([int(kind) for kind in rec.Kind]), st.binary(max_size=200))
def test_random_record_bodies_decode_or_fail_cleanly(kind: int, body: bytes) -> None:
    """Garbage behind a valid kind byte reaches the per-kind decoders."""
    with contextlib.suppress(*DECODE_ERRORS):
        rec.decode_record(bytes([kind]) + body)


@GARBAGE_SETTINGS
@given(
    st.sampled_from([int(kind) for kind in rec.Kind]),
    st.lists(st.sampled_from([0, 1, 4, 255, 2**31, 2**32 - 1]), min_size=1, max_size=8),
    st.binary(max_size=40),
)
def test_huge_counts_and_lengths_fail_fast(kind: int, counts: list[int], tail: bytes) -> None:
    """Length and count fields claiming far more than is there must not loop or allocate."""
    body = b"".join(struct.pack("<I", count) for count in counts) + tail
    with contextlib.suppress(*DECODE_ERRORS):
        rec.decode_record(bytes([kind]) + body)
    for decode in (rec.decode_message, rec.decode_entry):
        for prefix in (b"", b"\x00", b"\x01"):
            with contextlib.suppress(*DECODE_ERRORS):
                decode(prefix + body)


@GARBAGE_SETTINGS
@given(RECORDS, st.data())
def test_mutated_records_decode_or_fail_cleanly(record: rec.Record, data: st.DataObject) -> None:
    """Flip, cut or insert bytes in a valid record: decode or fail, never crash."""
    payload = bytearray(rec.encode_record(record))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4), label="mutations")):
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]), label="how")
        at = data.draw(st.integers(min_value=0, max_value=len(payload)), label="at")
        if how == "flip" and at < len(payload):
            payload[at] ^= data.draw(st.integers(min_value=1, max_value=255), label="mask")
        elif how == "cut":
            del payload[at:]
        else:
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=8), label="inserted")
    _decodes_or_fails_cleanly(bytes(payload))


@GARBAGE_SETTINGS
@given(ENTRIES, st.data())
def test_mutated_entries_decode_or_fail_cleanly(
    entry: Message | BatchEntry, data: st.DataObject
) -> None:
    payload = bytearray(rec.encode_entry(entry))
    at = data.draw(st.integers(min_value=0, max_value=max(0, len(payload) - 1)), label="at")
    if payload:
        payload[at] ^= data.draw(st.integers(min_value=1, max_value=255), label="mask")
    _decodes_or_fails_cleanly(bytes(payload))
