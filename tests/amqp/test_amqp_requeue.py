"""RabbitMQ's requeue semantics, with pika: whatever gives unacked messages back
(basic.reject and basic.nack with requeue, single and multiple, basic.recover, closing
the channel or the connection, the consumer process dying) makes them ready at once:
counted by a passive queue.declare, returned by basic.get, redelivered with
``redelivered`` set, at their original place ahead of the messages behind them.
basic.cancel leaves a consumer's deliveries unacked (the spec: it "does not affect
already delivered messages"), still to be acked or given back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pika
from pika.adapters.blocking_connection import BlockingChannel

from tests.amqp.conftest import connect, unique, wait_for
from tests.live_server import LiveServer


def _queue_with(channel: BlockingChannel, count: int) -> str:
    queue = unique("requeue")
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    for i in range(count):
        channel.basic_publish("", queue, str(i).encode())
    return queue


def _ready(channel: BlockingChannel, queue: str) -> int:
    return int(channel.queue_declare(queue, passive=True).method.message_count)


def _get(channel: BlockingChannel, queue: str) -> tuple[int, int, bool]:
    """basic.get: (delivery tag, body, redelivered)."""
    method, _properties, body = channel.basic_get(queue)
    assert method is not None, "basic.get found the queue empty"
    return method.delivery_tag, int(body), bool(method.redelivered)


def _get_all(channel: BlockingChannel, queue: str) -> list[tuple[int, bool]]:
    """Everything ready, in order, acked: (body, redelivered)."""
    got: list[tuple[int, bool]] = []
    while True:
        method, _properties, body = channel.basic_get(queue)
        if method is None:
            return got
        got.append((int(body), bool(method.redelivered)))
        channel.basic_ack(method.delivery_tag)


def _held(channel: BlockingChannel, queue: str, count: int) -> list[int]:
    """Take ``count`` messages with basic.get, unacked; returns their tags."""
    tags = [_get(channel, queue)[0] for _ in range(count)]
    assert _ready(channel, queue) == 5 - count
    return tags


def test_reject_and_nack_with_requeue_make_messages_ready_at_their_place(
    server: LiveServer,
) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        queue = _queue_with(ch, 5)
        first, second, third = _held(ch, queue, 3)
        ch.basic_reject(second, requeue=True)
        assert _ready(ch, queue) == 3
        ch.basic_nack(third, multiple=True, requeue=True)  # first and third
        assert _ready(ch, queue) == 5
        assert _get_all(ch, queue) == [(0, True), (1, True), (2, True), (3, False), (4, False)]
        assert first  # (taken back by the multiple nack)


def test_recover_requeues_every_unacked_delivery(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        queue = _queue_with(ch, 5)
        _held(ch, queue, 2)
        ch.basic_recover(requeue=True)
        assert _ready(ch, queue) == 5
        assert _get_all(ch, queue)[:3] == [(0, True), (1, True), (2, False)]


def test_closing_a_channel_or_connection_requeues_its_deliveries(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        queue = _queue_with(ch, 5)
        holder = conn.channel()
        _held(holder, queue, 2)
        holder.close()
        assert _ready(ch, queue) == 5
        with connect(server) as other:
            _held(other.channel(), queue, 3)
        assert _ready(ch, queue) == 5
        got = _get_all(ch, queue)
        assert got == [(0, True), (1, True), (2, True), (3, False), (4, False)]


def test_cancel_leaves_deliveries_unacked_until_the_channel_closes(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        queue = _queue_with(ch, 5)
        consuming = conn.channel()
        consuming.basic_qos(prefetch_count=3)
        tags: list[int] = []
        consumer = consuming.basic_consume(queue, lambda c, m, p, body: tags.append(m.delivery_tag))
        wait_for(lambda: (conn.process_data_events(time_limit=0.05), len(tags) == 3)[1])
        consuming.basic_cancel(consumer)
        assert _ready(consuming, queue) == 2  # still delivered, unacked
        consuming.basic_ack(tags[0])  # and still the channel's to settle
        consuming.basic_nack(tags[1], requeue=True)
        assert _ready(consuming, queue) == 3  # (asked after the nack, on its channel)
        consuming.close()
        assert _ready(ch, queue) == 4
        assert _get_all(ch, queue) == [(1, True), (2, True), (3, False), (4, False)]


def test_pikas_consumer_generator_cancel_requeues_what_it_buffered(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        queue = _queue_with(ch, 5)
        consuming = conn.channel()
        consuming.basic_qos(prefetch_count=5)
        for method, _properties, _body in consuming.consume(queue, inactivity_timeout=5):
            assert method is not None
            break  # the other four are buffered in pika, unacked
        consuming.cancel()  # rejects what it buffered, with requeue
        # (a delivery that crossed the cancel is rejected as it arrives: a moment later)
        wait_for(lambda: _ready(ch, queue) == 4)
        consuming.close()
        assert _ready(ch, queue) == 5


_CONSUMER = textwrap.dedent(
    """
    import sys
    import pika

    port, queue = int(sys.argv[1]), sys.argv[2]
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=3)
    held = []

    def on_message(ch, method, properties, body):
        held.append(body)
        if len(held) == 3:
            print("holding", flush=True)

    channel.basic_consume(queue, on_message)
    channel.start_consuming()
    """
)


def test_a_crashed_consumers_deliveries_are_ready_at_once(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        queue = _queue_with(ch, 5)
        child = subprocess.Popen(
            [sys.executable, "-c", _CONSUMER, str(server.port("amqp")), queue],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "holding"
            assert _ready(ch, queue) == 2
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        wait_for(lambda: _ready(ch, queue) == 5)
        assert _get_all(ch, queue) == [(0, True), (1, True), (2, True), (3, False), (4, False)]


def test_a_requeued_message_taken_again_is_not_counted_twice(server: LiveServer) -> None:
    with connect(server) as conn:
        ch = conn.channel()
        queue = _queue_with(ch, 3)
        tag, body, _ = _get(ch, queue)
        ch.basic_nack(tag, requeue=True)
        again, body_again, redelivered = _get(ch, queue)
        assert (body_again, redelivered) == (body, True)
        assert _ready(ch, queue) == 2
        ch.basic_ack(again)
        assert _ready(ch, queue) == 2
        assert [b for b, _ in _get_all(ch, queue)] == [1, 2]
        assert _ready(ch, queue) == 0


def _cancel_busy_consumer(conn: pika.BlockingConnection, ch: BlockingChannel) -> None:
    queue = _queue_with(ch, 30)
    consuming = conn.channel()
    consuming.basic_qos(prefetch_count=1)
    acked: list[int] = []

    def on_message(c: BlockingChannel, m: Any, _p: Any, body: bytes) -> None:
        acked.append(int(body))
        c.basic_ack(m.delivery_tag)

    tag = consuming.basic_consume(queue, on_message)
    wait_for(lambda: (conn.process_data_events(time_limit=0.001), len(acked) >= 10)[1])
    consuming.basic_cancel(tag)
    consuming.close()
    assert _ready(ch, queue) == 30 - len(acked)
    assert sorted(b for b, _ in _get_all(ch, queue)) == sorted(set(range(30)) - set(acked))


def test_a_busy_consumer_cancelled_loses_nothing_in_flight(server: LiveServer) -> None:
    """A consumer acking as it goes is always fetching its next message: cancelled
    and closed meanwhile, that fetch is let finish, so every unacked message is
    ready at once (a fetch cancelled halfway left one invisible, and uncounted)."""
    with connect(server) as conn:
        ch = conn.channel()
        for _ in range(5):
            _cancel_busy_consumer(conn, ch)
