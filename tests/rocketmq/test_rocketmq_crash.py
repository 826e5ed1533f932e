"""A server killed with SIGKILL keeps what RocketMQ acknowledged: every message whose
send returned a receipt, and every ack of a SimpleConsumer."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
from rocketmq import ClientConfiguration, Credentials, FilterExpression, Producer, SimpleConsumer

from tests.crash_server import crash_server
from tests.rocketmq.conftest import message

# The client logs through the deprecated Logger.warn when its server goes away.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOPIC = "crash-durable"
GROUP = "crash-group"
COUNT = 10
ACKED = 4
INVISIBLE_S = 30  # nothing received-but-unacked is left behind, so it never runs out
TIMEOUT_S = 30.0


def _config(port: int) -> Any:
    return ClientConfiguration(f"127.0.0.1:{port}", Credentials("", ""), "")


def _consumer(port: int) -> Any:
    consumer = SimpleConsumer(_config(port), GROUP, {TOPIC: FilterExpression()}, await_duration=1)
    consumer.startup()
    return consumer


def _receive_and_ack(consumer: Any, count: int) -> list[str]:
    """Receive (at most ``count`` in all) and ack until ``count`` were acked: ids."""
    acked: list[str] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(acked) < count:
        assert time.monotonic() < deadline, f"acked {len(acked)} of {count}"
        for got in consumer.receive(count - len(acked), INVISIBLE_S):
            consumer.ack(got)
            acked.append(got.message_id)
    return acked


def _shutdown(*clients: Any) -> None:
    for client in clients:
        with contextlib.suppress(Exception):
            client.shutdown()


def test_sent_messages_and_acks_survive_a_sigkill(tmp_path: Path) -> None:
    with crash_server(tmp_path, "rocketmq") as port:
        producer = Producer(_config(port), (TOPIC,))
        producer.startup()
        sent = [producer.send(message(TOPIC, b"%d" % i)).message_id for i in range(COUNT)]
        consumer = _consumer(port)
        acked = _receive_and_ack(consumer, ACKED)
        # killed here, clients still up: ACKED acked, the rest sent and never received
    _shutdown(producer, consumer)
    with crash_server(tmp_path, "rocketmq") as port:
        consumer = _consumer(port)
        try:
            rest = _receive_and_ack(consumer, COUNT - ACKED)
            assert consumer.receive(COUNT, INVISIBLE_S) == []
        finally:
            _shutdown(consumer)
    assert sorted(acked + rest) == sorted(sent)
    assert not set(acked) & set(rest)
