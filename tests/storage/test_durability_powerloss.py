"""Durability as the client asked (docs/performance.md): after a SIGKILL and a
simulated power loss (``tests/powerloss.py``: every commit-log segment cut back to
what the server had fsynced), everything acknowledged as durable is there, and so is
every message written before it (an fsync covers what came before); messages
acknowledged without durability after the last fsync are gone, which shows their
acknowledgement did not wait for one.

Each publisher alternates non-durable and durable sends, one at a time and each
acknowledged before the next, then ends with non-durable ones. The flush interval is
set far out so no timer fsyncs that tail before the kill.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pika
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tests.crash_server import crash_server
from tests.powerloss import lose_unsynced, prelude

PAIRS = 5  # non-durable, then durable, this many times
TAIL = 5  # non-durable sends after the last durable one
SETTINGS = {"storage.flush_interval_ms": "600000"}

EXPECTED = {b"d%d" % i for i in range(PAIRS)} | {b"n%d" % i for i in range(PAIRS)}
TAIL_BODIES = {b"n%d" % i for i in range(PAIRS, PAIRS + TAIL)}


def _sends() -> list[tuple[bytes, bool]]:
    """(body, durable) in send order."""
    sends = []
    for i in range(PAIRS):
        sends += [(b"n%d" % i, False), (b"d%d" % i, True)]
    return sends + [(b"n%d" % i, False) for i in range(PAIRS, PAIRS + TAIL)]


def _check(survivors: list[bytes]) -> None:
    got = set(survivors)
    assert len(got) == len(survivors), "a message is there twice"
    assert got >= EXPECTED, f"lost after the power loss: {sorted(EXPECTED - got)}"
    assert not got & TAIL_BODIES, "the non-durable tail was fsynced before its ack"


def _amqp_survivors(data: Path, queue: str) -> list[bytes]:
    """Restarted over ``data``: every message left in ``queue``, in order."""
    with crash_server(data, "amqp") as port:
        connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        channel = connection.channel()
        survivors = []
        while True:
            method, _, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            survivors.append(body)
        connection.close()
    return survivors


def test_amqp_persistent_survive_transient_tail_does_not(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    queue = "powerloss"
    with crash_server(data, "amqp", settings=SETTINGS, prelude=prelude(sync_log)) as port:
        connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        channel.confirm_delivery()  # basic_publish returns once confirmed
        for body, durable in _sends():
            mode = pika.DeliveryMode.Persistent if durable else pika.DeliveryMode.Transient
            channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=mode))
    with contextlib.suppress(Exception):
        connection.close()
    assert lose_unsynced(data, sync_log) > 0
    survivors = _amqp_survivors(data, queue)
    _check(survivors)


def test_amqp_persistent_without_confirms_is_written_only(tmp_path: Path) -> None:
    """Persistent messages wait for the fsync only where the client is told they are
    stored: committed in a transaction they survive the power loss; published on a
    channel with neither confirms nor a transaction after them, they are gone (their
    channel did not wait for an fsync), though the server had them."""
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    queue = "powerloss"
    committed = [b"t%d" % i for i in range(PAIRS)]
    unconfirmed = [b"u%d" % i for i in range(TAIL)]
    persistent = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
    with crash_server(data, "amqp", settings=SETTINGS, prelude=prelude(sync_log)) as port:
        connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        channel.tx_select()
        for body in committed:
            channel.basic_publish("", queue, body, persistent)
        channel.tx_commit()
        plain = connection.channel()
        for body in unconfirmed:
            plain.basic_publish("", queue, body, persistent)
        # Handled after the publishes before it on the channel: they are stored.
        stored = plain.queue_declare(queue, passive=True).method.message_count
        assert stored == len(committed) + len(unconfirmed)
    with contextlib.suppress(Exception):
        connection.close()
    assert lose_unsynced(data, sync_log) > 0
    survivors = _amqp_survivors(data, queue)
    assert survivors == committed, "committed lost, or unconfirmed ones fsynced"


def test_kafka_acks_all_survive_acks_1_tail_does_not(tmp_path: Path) -> None:
    data, sync_log = tmp_path / "data", tmp_path / "fsyncs"
    topic = "powerloss"
    with crash_server(data, "kafka", settings=SETTINGS, prelude=prelude(sync_log)) as port:
        bootstrap = f"127.0.0.1:{port}"
        producers = {
            acks: Producer({"bootstrap.servers": bootstrap, "acks": acks, "linger.ms": 0})
            for acks in ("all", "1")
        }
        errors: list[object] = []
        for body, durable in _sends():
            producer = producers["all" if durable else "1"]
            producer.produce(topic, body, on_delivery=lambda error, _: errors.append(error))
            assert producer.flush(30) == 0
        assert errors == [None] * len(_sends())
    assert lose_unsynced(data, sync_log) > 0
    with crash_server(data, "kafka") as port:
        consumer = Consumer(
            {
                "bootstrap.servers": f"127.0.0.1:{port}",
                "group.id": "powerloss",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        try:
            partition = TopicPartition(topic, 0)
            _, high = consumer.get_watermark_offsets(partition, timeout=30)
            consumer.assign([TopicPartition(topic, 0, 0)])
            survivors: list[bytes] = []
            while len(survivors) < high:
                message = consumer.poll(30)
                if message is None:
                    pytest.fail(f"only {len(survivors)} of {high} records could be read")
                assert message.error() is None, message.error()
                value = message.value()
                assert value is not None
                survivors.append(value)
        finally:
            consumer.close()
    _check(survivors)
