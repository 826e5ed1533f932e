"""AMQP's way to storage topics (docs/interop.md, addressing): ``x-polymq-topic`` on an
exchange appends its publishes to the topic, on a queue consumes the topic."""

from __future__ import annotations

import contextlib
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.processor import Caller
from polymq.protocols import interop
from polymq.storage.errors import TopicAlreadyExists
from polymq.storage.model import DEFAULT_NAMESPACE, AppendRequest, Message, QueueRef, TopicConfig
from tests.live_server import LiveServer, live_server

CALLER = Caller(principal=ANONYMOUS, namespace=DEFAULT_NAMESPACE, protocol="test")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("amqp-topics"), ("amqp",)) as live:
        yield live


@pytest.fixture
def channel(server: LiveServer) -> Iterator[BlockingChannel]:
    connection = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", server.port("amqp"), heartbeat=0)
    )
    ch = connection.channel()
    ch.confirm_delivery()
    yield ch
    connection.close()


def _topic() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def _read(server: LiveServer, topic: str, queue_id: int) -> list[Message]:
    ref = QueueRef(DEFAULT_NAMESPACE, topic, queue_id)
    result = server.call(lambda: server.gateway.processor.read(CALLER, ref, 0))
    return [stored.message for stored in result.messages]


def _declare_topic_exchange(channel: BlockingChannel, topic: str) -> None:
    channel.exchange_declare(
        topic, "fanout", durable=True, arguments={interop.AMQP_TOPIC_ARGUMENT: topic}
    )


def test_a_publish_creates_the_missing_topic_and_counts_as_routed(
    server: LiveServer, channel: BlockingChannel
) -> None:
    topic = _topic()
    _declare_topic_exchange(channel, topic)
    # No queue is bound: with mandatory set, an unroutable publish would be returned
    # (pika raises UnroutableError under confirms).
    channel.basic_publish(topic, "rk-1", b"hello", mandatory=True)
    info = server.call(lambda: server.gateway.processor.describe_topic(CALLER, topic))
    assert len(info.queues) == 1
    [message] = _read(server, topic, 0)
    assert message.body == b"hello" and message.key == b"rk-1"


def test_the_routing_key_picks_the_queue_of_a_larger_topic(
    server: LiveServer, channel: BlockingChannel
) -> None:
    topic = _topic()
    server.call(
        lambda: server.gateway.processor.create_topic(CALLER, topic, TopicConfig(queue_count=4))
    )
    _declare_topic_exchange(channel, topic)
    keys = [f"key-{i}" for i in range(8)]
    for key in keys:
        channel.basic_publish(topic, key, key.encode())
    for queue_id in range(4):
        want = [k.encode() for k in keys if zlib.crc32(k.encode()) % 4 == queue_id]
        assert [m.body for m in _read(server, topic, queue_id)] == want


def test_the_exchange_still_routes_to_its_bound_queues(
    server: LiveServer, channel: BlockingChannel
) -> None:
    topic = _topic()
    _declare_topic_exchange(channel, topic)
    bound = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(bound, topic)
    channel.basic_publish(topic, "", b"both")
    assert [m.body for m in _read(server, topic, 0)] == [b"both"]
    _, _, body = _get(channel, bound)
    assert body == b"both"


def _get(channel: BlockingChannel, queue: str, timeout_s: float = 20.0) -> Any:
    for method, properties, body in channel.consume(queue, inactivity_timeout=timeout_s):
        assert method is not None, f"nothing arrived in {queue} within {timeout_s} s"
        channel.basic_ack(method.delivery_tag)
        channel.cancel()
        return method, properties, body
    raise AssertionError("consume ended")


def test_a_view_queue_consumes_every_queue_of_the_topic(
    server: LiveServer, channel: BlockingChannel
) -> None:
    topic = _topic()
    processor = server.gateway.processor

    async def fill() -> None:
        await processor.create_topic(CALLER, topic, TopicConfig(queue_count=3))
        requests = [
            AppendRequest(
                entry=Message(body=f"m{i}".encode(), key=b"k", properties=(("n", b"1"),)),
                queues=(QueueRef(DEFAULT_NAMESPACE, topic, i),),
            )
            for i in range(3)
        ]
        await processor.append(CALLER, requests)

    server.call(fill)
    channel.queue_declare(topic, durable=True, arguments={interop.AMQP_TOPIC_ARGUMENT: topic})
    got = sorted(_get(channel, topic)[2] for _ in range(3))
    assert got == [b"m0", b"m1", b"m2"]
    _, properties, _ = _get_or_none(channel, topic)
    assert properties is None  # acked: nothing comes back
    # The topic itself is untouched for its other readers (Kafka, by offset).
    assert [m.body for m in _read(server, topic, 1)] == [b"m1"]


def _get_or_none(channel: BlockingChannel, queue: str) -> Any:
    for method, properties, body in channel.consume(queue, inactivity_timeout=1.0):
        channel.cancel()
        return method, properties, body
    return None, None, None


def test_a_view_waits_for_its_topic_and_outlives_its_deletion(
    server: LiveServer, channel: BlockingChannel
) -> None:
    topic = _topic()
    processor = server.gateway.processor
    channel.queue_declare(topic, durable=True, arguments={interop.AMQP_TOPIC_ARGUMENT: topic})
    arrived: list[bytes] = []
    channel.basic_consume(topic, lambda ch, method, props, body: arrived.append(body), True)
    channel.connection.process_data_events(time_limit=0.2)  # the consumer polls a void

    async def produce() -> None:
        ref = QueueRef(DEFAULT_NAMESPACE, topic)
        with contextlib.suppress(TopicAlreadyExists):
            await processor.create_topic(CALLER, topic, TopicConfig())
        await processor.append(CALLER, [AppendRequest(entry=Message(body=b"late"), queues=(ref,))])

    server.call(produce)
    _pump_until(channel, lambda: arrived == [b"late"])
    server.call(lambda: processor.delete_topic(CALLER, topic))
    channel.connection.process_data_events(time_limit=1.0)  # a pop on a deleted topic
    server.call(produce)  # the topic again: the consumer finds it
    _pump_until(channel, lambda: arrived == [b"late", b"late"])
    assert channel.is_open


def _pump_until(channel: BlockingChannel, done: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the view queue did not deliver in time"
        channel.connection.process_data_events(time_limit=0.1)
