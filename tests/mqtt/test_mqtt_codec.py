"""The codec: round trips at every level, incremental feeding, and the grammar's
errors (remaining length, UTF-8, flags, packet size)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polymq.protocols.mqtt import codec

PACKETS: list[tuple[codec.Packet, int]] = [
    (
        codec.Connect(
            level=5,
            client_id="c1",
            clean_start=False,
            keep_alive=30,
            username="u",
            password=b"p",
            will_topic="w/t",
            will_payload=b"bye",
            will_qos=1,
            will_retain=True,
            will_properties={codec.WILL_DELAY: 5},
            properties={codec.SESSION_EXPIRY: 60, codec.RECEIVE_MAXIMUM: 10},
        ),
        5,
    ),
    (codec.Connect(level=4, client_id="c", keep_alive=60), 4),
    (codec.Connect(level=3, client_id="old"), 3),
    (codec.ConnAck(session_present=True, reason=0, properties={codec.TOPIC_ALIAS_MAXIMUM: 9}), 5),
    (
        codec.Publish(
            topic="a/ü",
            payload=b"\x00\xff",
            qos=2,
            retain=True,
            dup=True,
            packet_id=65535,
            properties={
                codec.USER_PROPERTY: [("k", "1"), ("k", "2")],
                codec.SUBSCRIPTION_ID: [1, 268435455],
                codec.CORRELATION_DATA: b"id",
            },
        ),
        5,
    ),
    (codec.Publish(topic="t", payload=b"x" * 200), 4),
    (codec.PubAck(packet_id=1, reason=0x10, properties={codec.REASON_STRING: "why"}), 5),
    (codec.PubRel(packet_id=2), 4),
    (
        codec.Subscribe(
            packet_id=3,
            subscriptions=[
                codec.Subscription(filter="a/#", qos=2, no_local=True, retain_handling=2),
                codec.Subscription(filter="b", qos=1, retain_as_published=True),
            ],
            properties={codec.SUBSCRIPTION_ID: [4]},
        ),
        5,
    ),
    (codec.SubAck(packet_id=3, reasons=[0, 1, 0x80]), 4),
    (codec.Unsubscribe(packet_id=4, filters=["a", "b/+"]), 5),
    (codec.UnsubAck(packet_id=4, reasons=[0, 0x11]), 5),
    (codec.PingReq(), 4),
    (codec.Disconnect(reason=0x8E), 5),
]


@pytest.mark.parametrize(("packet", "level"), PACKETS)
def test_round_trip_byte_by_byte(packet: codec.Packet, level: int) -> None:
    data = codec.encode(packet, level)
    decoder = codec.Decoder(level=level)
    out: list[codec.Packet] = []
    for i in range(len(data)):
        out += decoder.feed(data[i : i + 1])
    assert out == [packet]


def test_packets_split_anywhere_over_three_reads() -> None:
    """Whole packets decoded from a read's own bytes, what is left of one kept for the
    next read: every way of cutting three packets into three reads gives them back."""
    packets = [packet for packet, level in PACKETS if level == 5][:3]
    data = b"".join(codec.encode(packet, 5) for packet in packets)
    for first in range(len(data) + 1):
        for second in range(first, len(data) + 1):
            decoder = codec.Decoder(level=5)
            out = decoder.feed(data[:first]) + decoder.feed(data[first:second])
            out += decoder.feed(data[second:])
            assert out == packets, (first, second)
            assert decoder.pending_bytes == 0


_TEXT = st.characters(exclude_characters="\x00", exclude_categories=["Cs"])


@given(
    topic=st.text(_TEXT, min_size=1, max_size=50),
    payload=st.binary(max_size=300),
    qos=st.integers(0, 2),
    user=st.lists(st.tuples(st.text(_TEXT, max_size=5), st.text(_TEXT, max_size=5)), max_size=3),
)
def test_publish_round_trip(
    topic: str, payload: bytes, qos: int, user: list[tuple[str, str]]
) -> None:
    props = {codec.USER_PROPERTY: user} if user else {}
    packet = codec.Publish(
        topic=topic, payload=payload, qos=qos, packet_id=7 if qos else 0, properties=props
    )
    assert codec.Decoder(level=5).feed(codec.encode(packet, 5) * 2) == [packet, packet]


def test_paho_captured_connect() -> None:
    # paho-mqtt 2.2 MQTTv311 CONNECT, client id "p", keep alive 60, clean session
    raw = bytes.fromhex("100d00044d5154540402003c000170")
    [packet] = codec.Decoder().feed(raw)
    assert packet == codec.Connect(level=4, client_id="p", keep_alive=60, clean_start=True)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\x30\xff\xff\xff\xff\x01", codec.MalformedPacket),  # 5-byte remaining length
        (b"\x30\x05\x00\x03a\xff\xfe", codec.MalformedPacket),  # bad UTF-8
        (b"\x30\x04\x00\x02a\x00", codec.MalformedPacket),  # U+0000 in a string
        (b"\x36\x03\x00\x01a", codec.MalformedPacket),  # QoS 3
        (b"\x80\x04\x00\x01\x00\x00", codec.MalformedPacket),  # SUBSCRIBE flags 0000
        (b"\x40\x03\x00\x01\x00", codec.MalformedPacket),  # trailing byte on v3 PUBACK
        (b"\xf0\x00", codec.MalformedPacket),  # AUTH before v5
    ],
)
def test_malformed(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        codec.Decoder(level=4).feed(data)


def test_size_limit_checked_from_the_header() -> None:
    with pytest.raises(codec.PacketTooLarge):
        codec.Decoder(level=4, max_packet_bytes=100).feed(b"\x30\xe8\x07")  # 1000 bytes


def test_unsupported_level() -> None:
    with pytest.raises(codec.UnsupportedProtocol):
        codec.Decoder().feed(b"\x10\x0c\x00\x04MQTT\x09\x02\x00\x3c\x00\x00")


@given(level=st.sampled_from([None, 3, 4, 5]), data=st.binary(max_size=200))
def test_any_bytes_give_packets_or_a_protocol_error(level: int | None, data: bytes) -> None:
    """Fuzz: the decoder never fails with anything but the codec's own errors."""
    decoder = codec.Decoder(level=level, max_packet_bytes=150)
    with contextlib.suppress(codec.MalformedPacket, codec.ProtocolError, codec.PacketTooLarge):
        decoder.feed(data)


@given(
    level=st.sampled_from([4, 5]),
    kind=st.integers(1, 15),
    flags=st.integers(0, 15),
    body=st.binary(max_size=60),
)
def test_well_framed_garbage_bodies(level: int, kind: int, flags: int, body: bytes) -> None:
    frame = bytes([(kind << 4) | flags, len(body)]) + body
    with contextlib.suppress(codec.MalformedPacket, codec.ProtocolError, codec.PacketTooLarge):
        codec.Decoder(level=level).feed(frame)


@given(
    topic=st.text(min_size=1, max_size=300),
    payload=st.binary(max_size=20_000),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    dup=st.booleans(),
    packet_id=st.integers(1, 65535),
)
def test_fast_v3_publish_is_the_same_bytes(
    topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int
) -> None:
    """The delivery path's encoder (no ``Publish`` object) makes what ``encode`` does,
    across the remaining length's 1-, 2- and 3-byte forms."""
    dup = dup and qos > 0
    packet = codec.Publish(
        topic=topic,
        payload=payload,
        qos=qos,
        retain=retain,
        dup=dup,
        packet_id=packet_id if qos else 0,
    )
    fast = codec.encode_publish_v3(
        topic.encode(), payload, qos, retain, dup, packet_id if qos else 0
    )
    assert fast == codec.encode(packet, codec.LEVEL_311)


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 129, 16383, 16384, 16385, 2_097_152])
@pytest.mark.parametrize("qos", [0, 1])
def test_fast_v3_publish_at_the_length_boundaries(size: int, qos: int) -> None:
    """Remaining lengths of exactly 127/128 and 16,383/16,384 bytes (and around)."""
    topic = "t/x"
    payload = b"p" * max(0, size - 2 - len(topic) - (2 if qos else 0))
    packet = codec.Publish(topic=topic, payload=payload, qos=qos, packet_id=9 if qos else 0)
    fast = codec.encode_publish_v3(topic.encode(), payload, qos, False, False, 9 if qos else 0)
    assert fast == codec.encode(packet, codec.LEVEL_311)


def _outcome(decode: Callable[[], codec.Packet]) -> object:
    try:
        return decode()
    except (codec.MalformedPacket, codec.ProtocolError) as e:
        return (type(e), str(e))


_PUBLISH_BODIES = st.one_of(
    st.binary(max_size=60),
    st.builds(
        lambda topic, slack, pid, payload, cut: (
            (max(0, len(topic) + slack)).to_bytes(2, "big") + topic + pid + payload
        )[: cut or None],
        st.one_of(st.binary(max_size=12), st.text(max_size=8).map(str.encode)),
        st.integers(-2, 2),
        st.sampled_from([b"", b"\x00\x00", b"\x00\x07", b"\x01"]),
        st.binary(max_size=8),
        st.integers(0, 30),
    ),
)


@given(body=_PUBLISH_BODIES, flags=st.integers(0, 15))
def test_fast_v3_publish_decoder_agrees_with_the_reader(body: bytes, flags: int) -> None:
    """The v3 PUBLISH fast path decodes what the general one does and refuses what
    it refuses, with the same error, for any body and flags (topic lengths off by
    a little, NUL and bad UTF-8 in topics, packet id 0, bodies cut short)."""
    fast = _outcome(lambda: codec._decode_publish_v3(body, flags))
    slow = _outcome(lambda: codec._decode_publish(codec._Reader(body, 0, len(body)), flags, False))
    assert fast == slow
