"""Connections in the registry, and what survives a gateway restart."""

from __future__ import annotations

from pathlib import Path

from tests.live_server import LiveServer, live_server
from tests.rocketmq.conftest import (
    factory,
    message,
    producer,
    receive_all,
    simple_consumer,
    unique,
    wait_until,
)


def rocketmq_connections(server: LiveServer) -> list[str | None]:
    return [c.client_id for c in server.gateway.connections.list(protocol="rocketmq")]


def test_clients_listed_as_connections(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        wait_until(lambda: len(rocketmq_connections(server)) == 2)
        assert set(rocketmq_connections(server)) == {p.client_id, c.client_id}
        [conn] = [
            x
            for x in server.gateway.connections.list(protocol="rocketmq")
            if x.client_id == p.client_id
        ]
        assert conn.namespace == "default"
    wait_until(lambda: rocketmq_connections(server) == [])


def test_messages_and_pop_state_survive_restart(tmp_path: Path) -> None:
    topic, group = unique("t"), unique("g")
    factories = {"rocketmq": factory()}
    with live_server(tmp_path, ("rocketmq",), factories=factories) as server:
        with producer(server, topic) as p:
            for i in range(3):
                p.send(message(topic, f"m{i}".encode()))
        with simple_consumer(server, group, topic) as c:
            got = receive_all(c, 3, invisible_s=1)
            c.ack(got[0])  # the other two stay in flight across the restart
    server_again = live_server(tmp_path, ("rocketmq",), factories=factories)
    with server_again as server, simple_consumer(server, group, topic) as c:
        rest = receive_all(c, 2, invisible_s=30)
        for m in rest:
            c.ack(m)
    assert sorted(m.body for m in rest) == sorted(m.body for m in got[1:])
    assert [m.delivery_attempt for m in rest] == [2, 2]
