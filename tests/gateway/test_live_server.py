"""The test harness that runs a real gateway in a thread: it serves, it stops, and a
second start over the same data directory sees what the first stored."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from polymq.storage.model import DEFAULT_NAMESPACE, AppendRequest, Message, QueueRef, TopicConfig
from tests.gateway.gateway_fakes import echo_listener
from tests.live_server import live_server


def test_serves_then_restarts_over_the_same_data(tmp_path: Path) -> None:
    factories = {"kafka": echo_listener}
    queue = QueueRef(DEFAULT_NAMESPACE, "t", 0)
    with live_server(tmp_path, ("kafka",), factories=factories) as server:
        with socket.create_connection(server.address("kafka"), timeout=10) as sock:
            sock.sendall(b"ping\n")
            assert sock.recv(5) == b"ping\n"
        storage = server.gateway.storage
        server.call(lambda: storage.create_topic(DEFAULT_NAMESPACE, "t", TopicConfig()))
        request = AppendRequest(entry=Message(body=b"kept"), queues=(queue,))
        server.call(lambda: storage.append([request]))
    with live_server(tmp_path, ("kafka",), factories=factories) as server:
        storage = server.gateway.storage
        read = server.call(lambda: storage.read(queue, 0, max_messages=10))
        assert [m.message.body for m in read.messages] == [b"kept"]


def test_refuses_a_listener_nobody_serves(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="amqp"), live_server(tmp_path, ("amqp",), factories={}):
        pass
