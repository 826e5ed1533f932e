"""A gateway serving AMQP on a free port, shared by a module's tests (each test uses
its own queue and exchange names), plus helpers to connect with pika."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from polymq.protocols.amqp.listener import amqp_listener
from tests.live_server import LiveServer, live_server

FACTORIES = {"amqp": amqp_listener}
WAIT_S = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("amqp"), ("amqp",), factories=FACTORIES) as live:
        yield live


def start(path: Path, **overrides: str) -> AbstractContextManager[LiveServer]:
    """A live server over ``path`` (for tests that restart it or change config)."""
    return live_server(path, ("amqp",), factories=FACTORIES, overrides=overrides)


def params(server: LiveServer, **kwargs: object) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(
        "127.0.0.1", server.port("amqp"), blocked_connection_timeout=WAIT_S, **kwargs
    )


def connect(server: LiveServer, **kwargs: object) -> pika.BlockingConnection:
    return pika.BlockingConnection(params(server, **kwargs))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def wait_for(condition: Callable[[], object], timeout: float = WAIT_S) -> None:
    """Poll ``condition`` until true (no sleep-and-hope: a bounded wait on a fact)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def drain(
    connection: pika.BlockingConnection,
    channel: pika.adapters.blocking_connection.BlockingChannel,
    queue: str,
    count: int,
    *,
    ack: bool = True,
) -> list[tuple[pika.spec.Basic.Deliver, pika.BasicProperties, bytes]]:
    """Consume ``count`` messages from ``queue`` (failing after a generous timeout)."""
    got: list[tuple[pika.spec.Basic.Deliver, pika.BasicProperties, bytes]] = []
    deadline = time.monotonic() + WAIT_S
    for method, properties, body in channel.consume(queue, inactivity_timeout=0.5):
        if method is not None:
            got.append((method, properties, body))
            if ack:
                channel.basic_ack(method.delivery_tag)
        if len(got) >= count or time.monotonic() > deadline:
            break
    channel.cancel()
    return got


@contextmanager
def channel_closed(code: int) -> Iterator[None]:
    """The block must end with the broker closing the channel with ``code``."""
    with pytest.raises(ChannelClosedByBroker) as info:
        yield
    assert info.value.reply_code == code, info.value.reply_text
