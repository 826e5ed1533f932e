"""rocketmq-python-client's SimpleConsumer: filters, invisibility, redelivery, DLQ."""

from __future__ import annotations

import pytest
from rocketmq import FilterExpression
from rocketmq.grpc_protocol import Code, FilterType
from rocketmq.v5.exception import BadRequestException

from polymq.protocols import interop
from polymq.storage.model import AppendRequest, GroupConfig, Message, QueueRef, TopicConfig
from tests.live_server import LiveServer
from tests.rocketmq.conftest import (
    ADMIN,
    create_topic,
    message,
    producer,
    receive_all,
    set_group,
    simple_consumer,
    unique,
)


def test_tag_filter(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p:
        for tag in ("a", "b", "c", "a"):
            p.send(message(topic, tag.encode(), tag=tag))
    with simple_consumer(server, group, topic, FilterExpression("a||c")) as c:
        got = receive_all(c, 3)
        for m in got:
            c.ack(m)
        assert sorted(m.tag for m in got) == ["a", "a", "c"]
        assert c.receive(32, 5) == []  # "b" was filtered out for this group


def test_sql92_filter(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p:
        for i in range(6):
            p.send(message(topic, str(i).encode(), tag="x", properties={"n": str(i)}))
    expression = FilterExpression("n >= 2 AND n BETWEEN 0 AND 4 AND TAGS = 'x'", FilterType.SQL)
    with simple_consumer(server, group, topic, expression) as c:
        got = receive_all(c, 3)
        for m in got:
            c.ack(m)
        assert sorted(m.body for m in got) == [b"2", b"3", b"4"]
        assert c.receive(32, 5) == []


def test_change_invisible_duration_redelivers(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        p.send(message(topic, b"again"))
        [first] = receive_all(c, 1, invisible_s=60)
        old_receipt = first.receipt_handle
        c.change_invisible_duration(first, 1)  # a nack with a 1 s delay
        assert first.receipt_handle != old_receipt
        [second] = receive_all(c, 1, invisible_s=60)
        assert second.message_id == first.message_id
        assert second.delivery_attempt == 2
        # the receipt of the first delivery is stale now
        first.receipt_handle = old_receipt
        with pytest.raises(BadRequestException) as e:
            c.ack(first)
        assert e.value.code == Code.INVALID_RECEIPT_HANDLE
        c.ack(second)


def test_redelivery_after_invisible_duration(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        p.send(message(topic, b"x"))
        [first] = receive_all(c, 1, invisible_s=1)
        [second] = receive_all(c, 1, invisible_s=30)  # not acked: back after 1 s
        assert (second.message_id, second.delivery_attempt) == (first.message_id, 2)
        with pytest.raises(BadRequestException):
            c.ack(first)  # expired receipt handle
        c.ack(second)


def test_dead_letter_after_max_attempts(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    set_group(server, group, GroupConfig(max_delivery_attempts=2))
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        receipt = p.send(message(topic, b"poison"))
        for attempt in (1, 2):
            [m] = receive_all(c, 1, invisible_s=1)
            assert m.delivery_attempt == attempt
        assert c.receive(32, 1) == []  # the third hand-out goes to the DLQ instead
    with simple_consumer(server, unique("dlq-reader"), f"%DLQ%{group}") as dlq:
        [dead] = receive_all(dlq, 1)
        dlq.ack(dead)
    assert dead.body == b"poison"
    assert dead.properties["DLQ_ORIGIN_MESSAGE_ID"] == receipt.message_id
    with simple_consumer(server, group, topic) as c:
        assert c.receive(32, 1) == []


def test_consumer_started_before_topic_exists(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with simple_consumer(server, group, topic) as c:
        assert c.receive(32, 5) == []  # waits out the long poll for the topic to appear
        with producer(server, topic) as p:
            p.send(message(topic, b"first", message_group="G"))
        [got] = receive_all(c, 1)
        c.ack(got)
    assert (got.body, got.message_group) == (b"first", "G")


def test_message_from_another_protocol_keeps_its_fields(server: LiveServer) -> None:
    """A message stored by another adapter (here: straight through the processor, as
    Kafka or AMQP would) reaches a RocketMQ consumer with its key, tag, properties and
    the interop fields as user properties."""
    topic, group = unique("t"), unique("g")
    create_topic(server, topic, TopicConfig(queue_count=1))
    stored = Message(
        body=b"from elsewhere",
        key=b"order-7",
        tag="created",
        properties=(("x-user", b"u1"),),
        content_type="application/json",
        correlation_id=b"corr-1",
        reply_to="replies",
    )
    request = AppendRequest(entry=stored, queues=(QueueRef("default", topic, 0),))
    server.call(lambda: server.gateway.processor.append(ADMIN, [request]))
    with simple_consumer(server, group, topic, FilterExpression("created")) as c:
        [got] = receive_all(c, 1)
        c.ack(got)
    assert got.body == b"from elsewhere"
    assert set(got.keys) == {"order-7"}
    assert got.tag == "created"
    assert got.properties == {
        "x-user": "u1",
        interop.CONTENT_TYPE: "application/json",
        interop.CORRELATION_ID: "corr-1",
        interop.REPLY_TO: "replies",
    }
