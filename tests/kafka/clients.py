"""Small helpers driving real Kafka clients with short timeouts, so tests stay fast."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer

__all__ = [
    "NODE_DIR",
    "confluent_consume",
    "confluent_consumer",
    "confluent_producer",
    "run_node",
    "wait_until",
]

NODE_DIR = Path(__file__).resolve().parents[1] / "nodejs"  # where kafkajs is installed

FAST = {
    "socket.timeout.ms": 10000,
    "topic.metadata.refresh.interval.ms": 1000,
    "reconnect.backoff.ms": 50,
    "reconnect.backoff.max.ms": 500,
}


def confluent_producer(bootstrap: str, **extra: Any) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **FAST, **extra})


def confluent_consumer(bootstrap: str, group: str, **extra: Any) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "enable.auto.commit": False,
            **FAST,
            **extra,
        }
    )


def confluent_consume(consumer: Consumer, count: int, timeout: float = 30.0) -> list[Message]:
    """Poll until ``count`` records arrived (or fail after ``timeout``)."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        message = consumer.poll(0.2)
        if message is None:
            continue
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                continue
            raise AssertionError(f"consumer error: {error}")
        got.append(message)
    assert len(got) == count, f"got {len(got)} of {count} records"
    return got


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.05)


def run_node(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a node script of tests/nodejs (where its ``require``s resolve)."""
    return subprocess.run(
        ["node", str(NODE_DIR / script), *args],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=NODE_DIR,
        check=False,
    )
