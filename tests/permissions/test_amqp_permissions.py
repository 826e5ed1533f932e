"""AMQP 0-9-1: a refusal of the permission model closes the channel with
access-refused (403), as RabbitMQ does, seen by pika; another vhost's resources are
out of reach (passive declare)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import ChannelClosedByBroker, ProbableAccessDeniedError

from tests.live_server import LiveServer
from tests.permissions.accounts import OTHER, PASSWORD, SHOP, permission_server

ACCESS_REFUSED = 403
NOT_FOUND = 404


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with permission_server(tmp_path_factory.mktemp("perm-amqp"), ("amqp",)) as s:
        yield s


def _connect(server: LiveServer, user: str, vhost: str = SHOP) -> pika.BlockingConnection:
    host, port = server.address("amqp")
    credentials = pika.PlainCredentials(user, PASSWORD)
    return pika.BlockingConnection(
        pika.ConnectionParameters(host, port, vhost, credentials, connection_attempts=1)
    )


def _refused(server: LiveServer, user: str, action: Callable[[BlockingChannel], object]) -> int:
    """The reply code of the channel error ``action`` provokes as ``user``."""
    connection = _connect(server, user)
    try:
        with pytest.raises(ChannelClosedByBroker) as caught:
            action(connection.channel())
        return int(caught.value.reply_code)
    finally:
        connection.close()


def _name(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def _setup(server: LiveServer, queue: str) -> None:
    """``queue`` with one message, made by an account without rules."""
    connection = _connect(server, "guest")
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"hello")
    connection.close()


def test_reader_reads_and_may_not_write_declare_or_delete(server: LiveServer) -> None:
    queue = _name("data-")
    _setup(server, queue)
    connection = _connect(server, "reader")
    channel = connection.channel()
    _, _, body = channel.basic_get(queue, auto_ack=True)
    assert body == b"hello"
    connection.close()

    def publish(ch: BlockingChannel) -> None:
        ch.confirm_delivery()
        ch.basic_publish("", queue, b"nope")

    assert _refused(server, "reader", publish) == ACCESS_REFUSED
    assert _refused(server, "reader", lambda ch: ch.queue_declare(_name("data-"))) == (
        ACCESS_REFUSED
    )
    assert _refused(server, "reader", lambda ch: ch.queue_delete(queue)) == ACCESS_REFUSED
    assert _refused(server, "reader", lambda ch: ch.queue_bind(queue, "amq.topic", "k")) == (
        ACCESS_REFUSED
    )


def test_writer_writes_and_may_not_consume_or_get(server: LiveServer) -> None:
    queue = _name("data-")
    _setup(server, queue)
    connection = _connect(server, "writer")
    channel = connection.channel()
    channel.confirm_delivery()
    channel.exchange_declare(_name("data-x"), "fanout")
    channel.basic_publish("", queue, b"more")
    connection.close()
    assert _refused(server, "writer", lambda ch: ch.basic_get(queue)) == ACCESS_REFUSED

    def consume(ch: BlockingChannel) -> None:
        ch.basic_consume(queue, lambda *_: None)

    assert _refused(server, "writer", consume) == ACCESS_REFUSED


def test_another_vhost_is_out_of_reach(server: LiveServer) -> None:
    queue = _name("data-")
    _setup(server, queue)
    with pytest.raises(ProbableAccessDeniedError):
        _connect(server, "outsider", SHOP)
    # In its own vhost, the name is simply not there.
    connection = _connect(server, "outsider", OTHER)
    try:
        with pytest.raises(ChannelClosedByBroker) as caught:
            connection.channel().queue_declare(queue, passive=True)
        assert caught.value.reply_code == NOT_FOUND
    finally:
        connection.close()
