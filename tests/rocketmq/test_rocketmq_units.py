"""The pure parts: SQL92 filters, tag expressions, signatures, message mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rocketmq.grpc_protocol import Code, definition_pb2

from polymq.protocols import interop
from polymq.protocols.rocketmq import auth, filters, mapping, sql92
from polymq.protocols.rocketmq.status import RpcFailure
from polymq.storage.model import Message, MessageType, QueueRef, StoredMessage

MESSAGE = Message(
    body=b"b", tag="t1", properties=(("a", b"5"), ("s", b"hello world"), ("flag", b"true"))
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("a = 5", True),
        ("a > 4 AND a <= 5", True),
        ("a <> 5", False),
        ("a BETWEEN 1 AND 4", False),
        ("a NOT BETWEEN 1 AND 4", True),
        ("s = 'hello world'", True),
        ("s IN ('x', 'hello world')", True),
        ("s NOT IN ('x')", True),
        ("missing IS NULL", True),
        ("missing IS NOT NULL", False),
        ("missing = 1", False),
        ("NOT missing = 1", True),
        ("TAGS = 't1' OR a = 0", True),
        ("(a = 0 OR a = 5) AND TAGS IN ('t1')", True),
        ("s CONTAINS 'lo w' AND s STARTSWITH 'he' AND s ENDSWITH 'ld'", True),
        ("flag = TRUE", True),
        ("s > 5", False),
        ("TRUE", True),
    ],
)
def test_sql92_evaluates(expression: str, expected: bool) -> None:
    assert sql92.evaluate(sql92.parse(expression), MESSAGE) is expected


@pytest.mark.parametrize("expression", ["", "a >", "a = 'x", "(a = 1", "a = 1 b", "a ~ 1", "IN"])
def test_sql92_rejects(expression: str) -> None:
    with pytest.raises(sql92.SqlError):
        sql92.parse(expression)


def _depth(expr: object) -> int:
    if not isinstance(expr, sql92.Expression):
        return 0
    return 1 + max((_depth(a) for a in expr.args), default=0)


def test_sql92_nesting_is_bounded() -> None:
    """Nesting past the limit is refused before the parser recurses (50,000 levels
    once raised RecursionError); up to the limit it parses and evaluates."""
    for fine, deeper in (
        ("(" * 64 + "a = 5" + ")" * 64, "(" * 65 + "a = 5" + ")" * 65),
        ("NOT " * 64 + "a = 5", "NOT " * 65 + "a = 5"),
    ):
        assert sql92.evaluate(sql92.parse(fine), MESSAGE) is True
        with pytest.raises(sql92.SqlError, match="deeper than 64"):
            sql92.parse(deeper)
    with pytest.raises(sql92.SqlError, match="deeper than 3"):
        sql92.parse("((((a = 5))))", max_depth=3)
    assert sql92.evaluate(sql92.parse("(((a = 5)))", max_depth=3), MESSAGE) is True
    deep = "(" * 5_000 + "a = 5" + ")" * 5_000
    with pytest.raises(RpcFailure) as e:
        filters.parse_filter(definition_pb2.SQL, deep)
    assert e.value.code == Code.ILLEGAL_FILTER_EXPRESSION


def test_sql92_chains_are_flat() -> None:
    """A chain of 1,500 ORs is one node (it was a 1,500-deep tree, and its evaluation
    raised RecursionError on every message), so depth stays with the nesting."""
    chain = " OR ".join(["a = 1"] * 1_500 + ["a = 5"])
    expr = sql92.parse(chain)
    assert _depth(expr) == 2
    assert sql92.evaluate(expr, MESSAGE) is True
    both = sql92.parse(" AND ".join(["a = 5"] * 1_500) + " OR TAGS = 'x'")
    assert _depth(both) == 3
    assert sql92.evaluate(both, MESSAGE) is True


def test_sql92_length_is_bounded() -> None:
    text = " OR ".join(["a = 1"] * 2_000)
    assert len(text) > sql92.MAX_LENGTH
    with pytest.raises(sql92.SqlError, match="exceeds the limit"):
        sql92.parse(text)
    assert sql92.parse(text, max_length=len(text)).op == "OR"


def test_tag_expressions() -> None:
    assert filters.parse_tags("*") is None
    assert filters.parse_tags(" ") is None
    assert filters.parse_tags("a || b||c") == frozenset({"a", "b", "c"})
    with pytest.raises(RpcFailure):
        filters.parse_tags("||")
    with pytest.raises(RpcFailure) as e:
        filters.parse_filter(definition_pb2.SQL, "a >")
    assert e.value.code == Code.ILLEGAL_FILTER_EXPRESSION


def test_signature_round_trip() -> None:
    signature = auth.sign("secret", "20250101T000000Z")
    headers = auth.read_headers(
        [
            (
                "authorization",
                "MQv2-HMAC-SHA1 Credential=AK, SignedHeaders=x-mq-date-time, "
                f"Signature={signature}",
            ),
            ("x-mq-date-time", "20250101T000000Z"),
            ("x-mq-namespace", "ns"),
            ("x-mq-client-id", "c1"),
        ]
    )
    assert (headers.access_key, headers.namespace, headers.client_id) == ("AK", "ns", "c1")
    auth.verify(headers, "secret")
    with pytest.raises(auth.SignatureError):
        auth.verify(headers, "other")
    with pytest.raises(auth.SignatureError):
        auth.parse_authorization("Bearer x")


def test_signature_date() -> None:
    assert auth.date_time_ms("19700101T000001Z") == 1000
    assert auth.date_time_ms("20250101T000000Z") == 1_735_689_600_000
    for bad in (
        "20250101T000000",
        "2025-01-01T00:00Z",
        "20251301T000000Z",
        "\uff12\uff10\uff12\uff150101T000000Z",
    ):
        with pytest.raises(auth.SignatureError):
            auth.date_time_ms(bad)
    headers = auth.RequestHeaders(date_time="20250101T000000Z")
    auth.check_date(headers, 1_735_689_600_000 + 5000, behind_ms=5000, ahead_ms=0)
    with pytest.raises(auth.SignatureError):
        auth.check_date(headers, 1_735_689_600_000 + 5001, behind_ms=5000, ahead_ms=0)
    with pytest.raises(auth.SignatureError):
        auth.check_date(headers, 1_735_689_600_000 - 1, behind_ms=5000, ahead_ms=0)


def test_mapping_round_trip() -> None:
    pb = definition_pb2.Message(body=b"payload")
    pb.topic.name = "t"
    props = pb.system_properties
    props.tag = "tag"
    props.keys.extend(["k1", "k2"])
    props.message_group = "g"
    props.born_host = "10.0.0.1"
    props.born_timestamp.seconds = 1_700_000_000
    pb.user_properties["user"] = "v"
    pb.user_properties[interop.CONTENT_TYPE] = "text/plain"
    message = mapping.from_proto(pb, max_body_bytes=100, now_ms=0)
    assert message.key == b"k1 k2"
    assert message.content_type == "text/plain"
    assert message.properties == (("user", b"v"),)
    assert mapping.message_type_of(pb) is MessageType.FIFO
    stored = StoredMessage(
        message=message,
        queue=QueueRef("default", "t", 3),
        offset=7,
        message_id="01ABC",
        store_timestamp_ms=1_700_000_001_000,
        delivery_attempt=2,
        receipt="r",
    )
    back = mapping.to_proto(stored, namespace="", message_type=MessageType.FIFO, store_host="h:1")
    assert back.body == b"payload"
    assert list(back.system_properties.keys) == ["k1", "k2"]
    assert back.system_properties.tag == "tag"
    assert back.system_properties.message_group == "g"
    assert back.system_properties.receipt_handle == "r"
    assert back.system_properties.queue_offset == 7
    assert back.system_properties.born_timestamp.seconds == 1_700_000_000
    assert dict(back.user_properties) == {"user": "v", interop.CONTENT_TYPE: "text/plain"}
    digest = back.system_properties.body_digest
    assert (digest.type, digest.checksum) == (
        definition_pb2.MD5,
        "321C3CF486ED509164EDEC1E1981FEC8",
    )


def test_mapping_checks() -> None:
    pb = definition_pb2.Message(body=b"x" * 11)
    with pytest.raises(RpcFailure) as e:
        mapping.from_proto(pb, max_body_bytes=10, now_ms=0)
    assert e.value.code == Code.MESSAGE_BODY_TOO_LARGE


_text = st.text(
    alphabet=st.characters(
        min_codepoint=0x21,
        max_codepoint=0x2FF,
        categories=("L", "N", "P", "S"),  # no control or white-space characters
        exclude_characters="|",
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(min_size=1, max_size=64),
    tag=st.none() | _text,
    keys=st.lists(_text.filter(lambda k: " " not in k), max_size=3, unique=True),
    group=st.none() | _text,
    user=st.dictionaries(
        _text.filter(lambda name: not interop.is_private(name)), st.text(max_size=8), max_size=4
    ),
)
def test_mapping_round_trips(
    body: bytes, tag: str | None, keys: list[str], group: str | None, user: dict[str, str]
) -> None:
    """What a producer sends comes back to a consumer field for field."""
    pb = definition_pb2.Message(body=body)
    pb.topic.name = "t"
    if tag is not None:
        pb.system_properties.tag = tag
    pb.system_properties.keys.extend(keys)
    if group is not None:
        pb.system_properties.message_group = group
    pb.user_properties.update(user)
    model = mapping.from_proto(pb, max_body_bytes=1 << 20, now_ms=0)
    stored = StoredMessage(
        message=model,
        queue=QueueRef("default", "t"),
        offset=0,
        message_id="m",
        store_timestamp_ms=1,
    )
    back = mapping.to_proto(stored, namespace="", message_type=MessageType.NORMAL, store_host="")
    assert back.body == body
    assert (back.system_properties.tag if back.system_properties.HasField("tag") else None) == tag
    assert list(back.system_properties.keys) == keys
    assert (
        back.system_properties.message_group
        if back.system_properties.HasField("message_group")
        else None
    ) == group
    assert dict(back.user_properties) == user


def test_slices_between_hand_the_loop_back_only_between_slices() -> None:
    """A one-slice request (a one-message send, a one-receipt ack) answers without an
    extra loop step; a bigger one lets another task run between its slices."""
    import asyncio

    from polymq.protocols.rocketmq.slicing import slices_between

    async def steps_of_another_task(count: int, size: int) -> tuple[list[slice], int]:
        ran = 0

        async def other() -> None:
            nonlocal ran
            while True:
                ran += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)  # it has run once
        ran = 0
        got = [part async for part in slices_between(count, size)]
        task.cancel()
        return got, ran

    assert asyncio.run(steps_of_another_task(1, 64)) == ([slice(0, 64)], 0)
    parts, ran = asyncio.run(steps_of_another_task(130, 64))
    assert parts == [slice(0, 64), slice(64, 128), slice(128, 192)] and ran == 2
