"""rocketmq-python-client's PushConsumer: listener consumption (concurrent and FIFO),
retries with the server's backoff, and the dead-letter queue after max attempts."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from rocketmq import ConsumeResult, FilterExpression, MessageListener, PushConsumer

from polymq.protocols.rocketmq import RocketMQListener
from polymq.storage.model import GroupConfig, QueueRef
from tests.live_server import LiveServer, live_server
from tests.rocketmq.conftest import (
    ADMIN,
    TEST_OPTIONS,
    client_config,
    factory,
    message,
    producer,
    receive_all,
    set_group,
    simple_consumer,
    started,
    unique,
    wait_until,
)


class Recorder(MessageListener):  # type: ignore[misc]
    """Records every delivery; ``decide`` says whether it succeeds."""

    def __init__(self, decide: Callable[[Any], bool] = lambda m: True) -> None:
        self.decide = decide
        self.deliveries: list[tuple[bytes, int, str | None]] = []
        self.lock = threading.Lock()

    def consume(self, message: Any) -> Any:
        with self.lock:
            self.deliveries.append((message.body, message.delivery_attempt, message.message_group))
        return ConsumeResult.SUCCESS if self.decide(message) else ConsumeResult.FAILURE

    def bodies(self) -> list[bytes]:
        with self.lock:
            return [body for body, _, _ in self.deliveries]


@contextmanager
def push_consumer(server: LiveServer, group: str, topic: str, listener: Any) -> Iterator[Any]:
    consumer = PushConsumer(
        client_config(server),
        group,
        listener,
        {topic: FilterExpression()},
        consumption_thread_count=4,
    )
    with started(consumer):
        yield consumer


def pending(server: LiveServer, group: str, topic: str) -> int:
    async def count() -> int:
        processor = server.gateway.processor
        total = 0
        for q in range(8):
            total += await processor.pending_count(ADMIN, group, QueueRef("default", topic, q))
        return total

    return server.call(count)


def test_push_consumes_and_acks(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    recorder = Recorder()
    with producer(server, topic) as p:
        for i in range(20):
            p.send(message(topic, f"m{i}".encode()))
        with push_consumer(server, group, topic, recorder):
            wait_until(lambda: len(recorder.bodies()) >= 20)
            wait_until(lambda: pending(server, group, topic) == 0)
    assert sorted(recorder.bodies()) == sorted(f"m{i}".encode() for i in range(20))


def test_push_retries_failed_message(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    recorder = Recorder(decide=lambda m: m.delivery_attempt >= 2)
    with producer(server, topic) as p, push_consumer(server, group, topic, recorder):
        p.send(message(topic, b"flaky"))
        wait_until(lambda: len(recorder.deliveries) >= 2)
        wait_until(lambda: pending(server, group, topic) == 0)
    assert recorder.deliveries[:2] == [(b"flaky", 1, None), (b"flaky", 2, None)]


def test_push_fifo_keeps_group_order(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    set_group(server, group, GroupConfig(fifo=True))
    recorder = Recorder()
    with producer(server, topic) as p:
        for i in range(10):
            p.send(message(topic, f"a{i}".encode(), message_group="A"))
            p.send(message(topic, f"b{i}".encode(), message_group="B"))
        with push_consumer(server, group, topic, recorder) as consumer:
            wait_until(lambda: len(recorder.bodies()) >= 20)
            assert consumer.fifo
    bodies = recorder.bodies()
    assert [b for b in bodies if b.startswith(b"a")] == [f"a{i}".encode() for i in range(10)]
    assert [b for b in bodies if b.startswith(b"b")] == [f"b{i}".encode() for i in range(10)]


def test_push_dead_letters_after_max_attempts(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    set_group(server, group, GroupConfig(max_delivery_attempts=2))
    recorder = Recorder(decide=lambda m: False)
    with producer(server, topic) as p, push_consumer(server, group, topic, recorder):
        p.send(message(topic, b"poison"))
        wait_until(lambda: len(recorder.deliveries) >= 2)
        with simple_consumer(server, unique("dlq"), f"%DLQ%{group}") as dlq:
            [dead] = receive_all(dlq, 1)
            dlq.ack(dead)
    assert dead.body == b"poison"
    assert [attempt for _, attempt, _ in recorder.deliveries] == [1, 2]


def test_push_fifo_failure_forwarded_to_dead_letter_queue(server: LiveServer) -> None:
    """A FIFO push consumer retries locally, then calls ForwardMessageToDeadLetterQueue
    so the group's next message is not held back for ever."""
    topic, group = unique("t"), unique("g")
    set_group(server, group, GroupConfig(fifo=True, max_delivery_attempts=2))
    recorder = Recorder(decide=lambda m: m.body != b"poison")
    with producer(server, topic) as p, push_consumer(server, group, topic, recorder):
        p.send(message(topic, b"poison", message_group="A"))
        p.send(message(topic, b"next", message_group="A"))
        wait_until(lambda: b"next" in recorder.bodies())
        with simple_consumer(server, unique("dlq"), f"%DLQ%{group}") as dlq:
            [dead] = receive_all(dlq, 1)
            dlq.ack(dead)
    assert dead.body == b"poison"
    bodies = recorder.bodies()
    assert bodies.count(b"poison") == 2  # the group's max attempts, consumed locally
    assert bodies.index(b"next") > bodies.index(b"poison")


@pytest.fixture
def short_invisible_server(tmp_path: Path) -> Iterator[LiveServer]:
    """Push consumers' messages invisible for 1.5 s only (renewed while held)."""
    options = dataclasses.replace(TEST_OPTIONS, default_invisible_ms=1_500)
    with live_server(tmp_path, ("rocketmq",), factories={"rocketmq": factory(options)}) as live:
        yield live


def test_push_slow_listener_renewed_not_redelivered(short_invisible_server: LiveServer) -> None:
    server = short_invisible_server
    topic, group = unique("t"), unique("g")
    listener = server.gateway.listeners.get("rocketmq")
    assert isinstance(listener, RocketMQListener)

    def slow(message: Any) -> bool:
        time.sleep(4)  # longer than the invisible time: kept invisible by renewal
        return True

    recorder = Recorder(decide=slow)
    with producer(server, topic) as p, push_consumer(server, group, topic, recorder):
        p.send(message(topic, b"slow"))
        wait_until(lambda: pending(server, group, topic) == 0)
        # released on ack (just after storage took the ack: wait for it)
        wait_until(lambda: len(listener.services.renewer) == 0)
    assert recorder.deliveries == [(b"slow", 1, None)]
