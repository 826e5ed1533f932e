"""A server killed with SIGKILL keeps what AMQP acknowledged: every message confirmed
to a publisher (persistent, on a durable queue) and every consumer ack.

Messages delivered but not acked stay leased to the dead channel until the lease runs
out (``protocols.amqp.consumer.INVISIBLE_MS``, a minute), then come back redelivered:
too long a wait for this suite (a scratch run that waited saw all of them come back,
redelivered), so the test takes them as either still leased or back and redelivered,
and checks that the acked ones never come back and the rest is all there."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pika
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from tests.crash_server import crash_server

QUEUE = "crash-durable"
COUNT = 20
ACKED = 6
UNACKED = 4
PERSISTENT = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)


def _connect(port: int) -> tuple[BlockingConnection, BlockingChannel]:
    params = pika.ConnectionParameters("127.0.0.1", port, blocked_connection_timeout=30)
    connection = BlockingConnection(params)
    return connection, connection.channel()


def _drain(channel: BlockingChannel) -> list[tuple[bytes, bool]]:
    """Everything in the queue, acked as read: (body, redelivered)."""
    got: list[tuple[bytes, bool]] = []
    while True:
        method, _, body = channel.basic_get(QUEUE, auto_ack=True)
        if method is None:
            return got
        got.append((body, bool(method.redelivered)))


def test_confirmed_messages_and_acks_survive_a_sigkill(tmp_path: Path) -> None:
    with crash_server(tmp_path, "amqp") as port:
        publisher, channel = _connect(port)
        channel.queue_declare(QUEUE, durable=True)
        channel.confirm_delivery()  # basic_publish now returns only once confirmed
        for i in range(COUNT):
            channel.basic_publish("", QUEUE, b"%d" % i, PERSISTENT, mandatory=True)
        consumer, inbox = _connect(port)
        tags = []
        for _ in range(ACKED + UNACKED):
            method, _, _ = inbox.basic_get(QUEUE)
            assert method is not None
            tags.append(method.delivery_tag)
        for tag in tags[:ACKED]:
            inbox.basic_ack(tag)
        # AMQP acks have no reply: a synchronous call on the same channel after them
        # returns only once the server handled the acks before it.
        ready = inbox.queue_declare(QUEUE, passive=True).method.message_count
        assert ready == COUNT - ACKED - UNACKED
        # killed here, both clients still connected, UNACKED deliveries outstanding
    for connection in (publisher, consumer):
        with contextlib.suppress(Exception):
            connection.close()
    with crash_server(tmp_path, "amqp") as port:
        connection, channel = _connect(port)
        got = _drain(channel)
        connection.close()
    unacked = {(b"%d" % i, True) for i in range(ACKED, ACKED + UNACKED)}
    rest = [(b"%d" % i, False) for i in range(ACKED + UNACKED, COUNT)]
    assert sorted(item for item in got if item not in unacked) == sorted(rest)
