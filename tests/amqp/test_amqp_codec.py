"""The pure parts, without a server: the frame codec (property tests: any split of
the byte stream gives the same frames; garbage raises only the codec's own errors),
topic matching against a reference, headers matching, x-death bookkeeping."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands

from polymq.protocols.amqp.codec import (
    PROTOCOL_HEADER,
    ContentHeaderFrame,
    FrameError,
    FrameReader,
    ProtocolHeaderError,
    confirm_frame,
    content_frames,
    deliver_frames,
    method_frame,
)
from polymq.protocols.amqp.dead_letter import add_death
from polymq.protocols.amqp.properties import decode_properties, encode_properties
from polymq.protocols.amqp.routing import headers_match, topic_matches


def _frames(data: bytes, chunks: list[int], *, header: bool = False) -> list[tuple[int, Any]]:
    reader = FrameReader(frame_max=131072, hard_max=1 << 24, expect_header=header)
    out: list[tuple[int, Any]] = []
    pos = 0
    for size in [*chunks, len(data)]:
        reader.receive_data(data[pos : pos + size])
        pos += size
        while (frame := reader.next_frame()) is not None:
            out.append((frame.channel, frame.value))
    return out


def _comparable(frame: tuple[int, Any]) -> object:
    channel, value = frame
    if isinstance(value, ContentHeaderFrame):
        return channel, value.class_id, value.body_size, value.raw_properties
    if isinstance(value, bytes):
        return channel, value
    return channel, type(value).__name__, dict(value)


bodies = st.binary(max_size=3000)
texts = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)


@settings(max_examples=60, deadline=None)
@given(body=bodies, chunks=st.lists(st.integers(1, 500), max_size=20), key=texts)
def test_any_split_of_the_stream_gives_the_same_frames(
    body: bytes, chunks: list[int], key: str
) -> None:
    raw = encode_properties(commands.Basic.Properties(content_type="t", headers={"k": key}))
    data = deliver_frames(
        3,
        consumer_tag="ctag",
        delivery_tag=7,
        redelivered=True,
        exchange="ex",
        routing_key=key[:50],
        raw_properties=raw,
        body=body,
        frame_max=4096,
    )
    frames = _frames(data, chunks)
    assert [_comparable(f) for f in frames] == [_comparable(f) for f in _frames(data, [])]
    channel, deliver = frames[0]
    assert channel == 3 and isinstance(deliver, commands.Basic.Deliver)
    assert deliver.delivery_tag == 7 and deliver.redelivered and deliver.routing_key == key[:50]
    _, header = frames[1]
    assert isinstance(header, ContentHeaderFrame)
    assert header.body_size == len(body) and header.raw_properties == raw
    assert header.properties.headers == {"k": key}
    chunks_out = [value for _, value in frames[2:]]
    assert b"".join(chunks_out) == body
    assert all(len(c) <= 4096 - 8 for c in chunks_out)


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(min_size=1, max_size=200))
def test_garbage_raises_only_codec_errors(garbage: bytes) -> None:
    reader = FrameReader(frame_max=4096, hard_max=1 << 20)
    reader.receive_data(PROTOCOL_HEADER + garbage)
    try:
        while reader.next_frame() is not None:
            pass
    except FrameError:
        pass


def test_wrong_header_is_reported_early() -> None:
    reader = FrameReader(frame_max=4096, hard_max=1 << 20)
    reader.receive_data(b"HTTP")
    with pytest.raises(ProtocolHeaderError):
        reader.next_frame()


def test_frame_size_is_checked_before_the_payload_arrives() -> None:
    reader = FrameReader(frame_max=4096, hard_max=1 << 20, expect_header=False)
    reader.receive_data(b"\x01\x00\x01\x00\x01\x00\x00")  # announces 64 KiB, sends none
    with pytest.raises(FrameError, match="frame_max"):
        reader.next_frame()


def test_empty_body_has_no_body_frame() -> None:
    data = content_frames(1, encode_properties(commands.Basic.Properties()), b"", 4096)
    assert len(_frames(data, [])) == 1
    assert _frames(method_frame(0, commands.Connection.CloseOk()), [])[0][0] == 0


def _brute(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_brute(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _brute(rest, words[1:])


words = st.sampled_from(["a", "b", "c", ""])


@settings(max_examples=300, deadline=None)
@given(
    binding=st.lists(st.sampled_from(["a", "b", "*", "#"]), min_size=1, max_size=5),
    key=st.lists(words, min_size=1, max_size=5),
)
def test_topic_matching_agrees_with_brute_force(binding: list[str], key: list[str]) -> None:
    assert topic_matches(".".join(binding), ".".join(key)) == _brute(binding, key)


def test_headers_matching() -> None:
    assert headers_match((("x-match", "all"), ("a", "1")), {"a": "1", "b": 2})
    assert not headers_match((("x-match", "all"), ("a", "1"), ("b", 3)), {"a": "1", "b": 2})
    assert headers_match((("x-match", "any"), ("a", "9"), ("b", 2)), {"a": "1", "b": 2})
    assert headers_match((("a", None),), {"a": "anything"})
    assert headers_match((("a", "1"),), {"a": b"1"})
    assert not headers_match((("x-match", "any-with-x"), ("x-k", "v")), {"x-k": "w"})


def test_x_death_counts_repeats_per_queue_and_reason() -> None:
    now = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    props = commands.Basic.Properties(expiration="100", headers={"h": 1})
    once = add_death(props, queue="q", reason="expired", exchange="e", routing_keys=["k"], now=now)
    twice = add_death(once, queue="q", reason="expired", exchange="e", routing_keys=["k"], now=now)
    other = add_death(
        twice, queue="q2", reason="rejected", exchange="", routing_keys=["q2"], now=now
    )
    headers: Any = decode_properties(encode_properties(other)).headers
    deaths = headers["x-death"]
    assert [(d["queue"], d["reason"], d["count"]) for d in deaths] == [
        ("q2", "rejected", 1),
        ("q", "expired", 2),
    ]
    assert other.expiration is None and headers["h"] == 1
    assert headers["x-first-death-queue"] == "q"
    assert headers["x-last-death-queue"] == "q2"
    assert deaths[1]["original-expiration"] == "100"


def _method_payload(frame_bytes: bytes) -> bytes:
    return frame_bytes[7:-1]


def _generic(cls: type, payload: bytes) -> Any:
    """What the table-driven decoder makes of a method payload (or its error)."""
    from polymq.protocols.amqp.fields import FieldError, decode_arguments

    try:
        return decode_arguments(cls, payload, 4, 64)
    except (FieldError, IndexError, ValueError) as e:
        return e


@settings(max_examples=300, deadline=None)
@given(
    exchange=st.text(max_size=40),
    routing_key=st.text(max_size=80),
    bits=st.integers(0, 255),
    ticket=st.integers(0, 0xFFFF),
    delivery_tag=st.integers(-(2**63), 2**63 - 1),
    cut=st.integers(0, 12),
    tail=st.binary(max_size=3),
    bad_utf8=st.booleans(),
)
def test_fast_publish_and_ack_decode_as_the_generic_decoder(
    exchange: str,
    routing_key: str,
    bits: int,
    ticket: int,
    delivery_tag: int,
    cut: int,
    tail: bytes,
    bad_utf8: bool,
) -> None:
    """basic.publish and basic.ack have a decoder of their own (the hot path): for any
    arguments, and payloads cut short, padded or not UTF-8, it gives what the generic
    decoder gives, and a payload the generic decoder refuses is a FrameError."""
    import struct

    ex = exchange.encode()[:255]
    rk = routing_key.encode()[:255]
    if bad_utf8 and rk:
        rk = b"\xff" + rk[1:]
    publish = struct.pack(">IH", commands.Basic.Publish.index, ticket)
    publish += bytes((len(ex),)) + ex + bytes((len(rk),)) + rk + bytes((bits,))
    ack = struct.pack(">IqB", commands.Basic.Ack.index, delivery_tag, bits)
    for cls, payload in ((commands.Basic.Publish, publish), (commands.Basic.Ack, ack)):
        for variant in (payload, payload[: max(4, len(payload) - cut)], payload + tail):
            data = struct.pack(">BHI", 1, 1, len(variant)) + variant + b"\xce"
            expected = _generic(cls, variant)
            reader = FrameReader(frame_max=0, hard_max=1 << 20, expect_header=False)
            reader.receive_data(data)
            if isinstance(expected, Exception):
                with pytest.raises(FrameError):
                    reader.next_frame()
                continue
            got = reader.next_frame()
            assert got is not None
            assert type(got.value) is cls
            assert {k: getattr(got.value, k) for k in cls.__slots__} == {
                k: getattr(expected, k) for k in cls.__slots__
            }


@given(
    channel=st.integers(0, 0xFFFF),
    delivery_tag=st.integers(0, 2**63 - 1),
    multiple=st.booleans(),
)
def test_confirm_frame_is_pamqps_basic_ack(channel: int, delivery_tag: int, multiple: bool) -> None:
    """Publisher confirms are packed by hand: byte for byte pamqp's basic.ack."""
    expected = commands.Basic.Ack(delivery_tag=delivery_tag, multiple=multiple)
    assert confirm_frame(channel, delivery_tag, multiple) == method_frame(channel, expected)


def _publish_frames(channel: int, key: str, body: bytes, frame_max: int, mandatory: bool) -> bytes:
    raw = encode_properties(commands.Basic.Properties(delivery_mode=2, headers={"k": key}))
    method = commands.Basic.Publish(exchange="ex", routing_key=key, mandatory=mandatory)
    return method_frame(channel, method) + content_frames(channel, raw, body, frame_max)


def _read_all(data: bytes, chunks: list[int], *, whole: bool) -> list[object]:
    """Every frame of ``data`` fed in ``chunks``: with ``whole``, publishes are taken
    with next_publish where it can (expanded to their frames), as the server reads; an
    error ends the list with its type."""
    reader = FrameReader(frame_max=4096, hard_max=1 << 20, expect_header=False)
    out: list[object] = []
    pos = 0
    try:
        for size in [*chunks, len(data)]:
            reader.receive_data(data[pos : pos + size])
            pos += size
            while True:
                publish = reader.next_publish() if whole else None
                if publish is not None:
                    # Whole means whole: the body the header announces, all of it.
                    assert len(publish.body) == publish.header.body_size
                    assert publish.frames == (3 if publish.body else 2)
                    ch = publish.channel
                    out.append(_comparable((ch, publish.method)))
                    out.append(_comparable((ch, publish.header)))
                    if publish.frames == 3:
                        out.append(_comparable((ch, publish.body)))
                    continue
                frame = reader.next_frame()
                if frame is None:
                    break
                out.append(_comparable((frame.channel, frame.value)))
    except FrameError as e:
        out.append(("error", type(e).__name__, e.reply_code))
    out.append(("frames", reader.frames_read))
    return out


@settings(max_examples=150, deadline=None)
@given(
    publishes=st.lists(
        st.tuples(st.integers(1, 3), texts, st.binary(max_size=6000), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    chunks=st.lists(st.integers(1, 700), max_size=30),
    damage=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(0, 255))),
)
def test_publishes_read_whole_give_the_frames_read_one_by_one(
    publishes: list[tuple[int, str, bytes, bool]],
    chunks: list[int],
    damage: tuple[int, int] | None,
) -> None:
    """next_publish (a publish's three frames read in one go, the server's hot path)
    gives exactly what next_frame gives frame by frame, for any split of the stream,
    bodies of one or several frames or none, an ack between, and one byte damaged
    anywhere (then both stop at the same frame with the same error)."""
    data = b"".join(
        _publish_frames(ch, key[:50], body, 4096, mandatory)
        + method_frame(ch, commands.Basic.Ack(delivery_tag=1))
        for ch, key, body, mandatory in publishes
    )
    if damage is not None:
        at, byte = damage
        at %= len(data)
        data = data[:at] + bytes((byte,)) + data[at + 1 :]
    assert _read_all(data, chunks, whole=True) == _read_all(data, [], whole=False)
