"""Parked connections (protocols/mqtt/tcp_listener.py): a TCP connection idle for
``park_after_s`` keeps its state but no task. It must still get what is published
to it, wake for what its client sends (again and again), expire on its keep-alive
with its will, and close on a kick or a server stop as a busy one does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.options import MqttOptions
from polymq.protocols.mqtt.tcp_listener import MqttTcpListener
from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho, RawClient, mqtt_server, wait_until

PARK_AFTER_S = 0.2


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    with mqtt_server(tmp_path, options=MqttOptions(park_after_s=PARK_AFTER_S)) as live:
        yield live


def _listener(server: LiveServer) -> MqttTcpListener:
    listener = server.gateway.listeners.get("mqtt")
    assert isinstance(listener, MqttTcpListener)
    return listener


def _parked(server: LiveServer, count: int) -> None:
    listener = _listener(server)
    wait_until(lambda: listener.parked_connections == count, what=f"{count} parked")


def test_parked_connections_deliver_and_wake_again_and_again(server: LiveServer) -> None:
    port = server.port("mqtt")
    sub = Paho(port).connect()
    sub.subscribe("park/t", qos=1)
    pub = Paho(port).connect()
    for round_ in range(3):
        _parked(server, 2)  # both idle: the publisher wakes, the subscriber gets it
        pub.publish("park/t", f"m{round_}".encode(), qos=1)
        got = sub.wait_messages(round_ + 1)
        assert got[-1].payload == f"m{round_}".encode()
    sub.disconnect()
    pub.disconnect()


def test_a_parked_connection_answers_a_ping(server: LiveServer) -> None:
    raw = RawClient(server.port("mqtt"), level=codec.LEVEL_311)
    raw.connect("pinger", keep_alive=600)
    for _ in range(3):
        _parked(server, 1)
        raw.send(codec.PingReq())
        assert isinstance(raw.receive(), codec.PingResp)
    raw.close()


def test_a_parked_connection_expires_on_its_keep_alive_with_its_will(
    server: LiveServer,
) -> None:
    port = server.port("mqtt")
    watcher = Paho(port).connect()
    watcher.subscribe("park/will", qos=1)
    raw = RawClient(port, level=codec.LEVEL_311)
    raw.connect("silent", keep_alive=1, will_topic="park/will", will_payload=b"gone")
    assert raw.closed() == []  # v3: closed without a word, 1.5 s after its last packet
    got = watcher.wait_messages(1, "the will")
    assert got[0].payload == b"gone"
    watcher.disconnect()


def test_a_parked_connection_is_closed_by_a_kick(server: LiveServer) -> None:
    raw = RawClient(server.port("mqtt"))
    raw.connect("kicked", keep_alive=600)
    _parked(server, 1)
    registry = server.gateway.connections
    (conn,) = registry.list(protocol="mqtt")

    async def kick() -> None:
        await registry.close(conn.id)

    server.call(kick)
    packets = raw.closed()  # v5: DISCONNECT "server shutting down", then the close
    assert [type(p) for p in packets] == [codec.Disconnect]
    assert len(registry) == 0
