"""A QoS 0 subscriber that reads more slowly than its publisher: past
``MqttOptions.qos0_drop_bytes`` behind, its QoS 0 deliveries are dropped (as Mosquitto
and EMQX drop them), the drops are counted in ``$SYS/broker/publish/messages/dropped``,
every message is either delivered or counted, and once the client catches up it gets
new messages again."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.options import MqttOptions
from tests.mqtt.helpers import TIMEOUT, Paho, RawClient, mqtt_server

_LIMIT = 64 << 10  # the server holds at most this much for the slow client
_SIZE = 4096
_BATCH = 200
_MAX_PUBLISHED = 8_000  # 32 MiB: far more than the limit and both sockets' buffers


def _slow_client(port: int) -> RawClient:
    """A v3.1.1 client whose socket takes little before it reads (a small receive
    buffer, set before connecting so the window is small from the start)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(TIMEOUT)
    sock.connect(("127.0.0.1", port))
    client = RawClient.__new__(RawClient)
    client.sock, client.level = sock, codec.LEVEL_311
    client.decoder, client.pending = codec.Decoder(level=codec.LEVEL_311), []
    return client


def _dropped(watcher: Paho) -> int:
    with watcher.lock:
        return int(watcher.messages[-1].payload) if watcher.messages else 0


def test_a_slow_qos0_subscriber_loses_messages_counted_and_then_gets_new_ones(
    tmp_path: Path,
) -> None:
    options = MqttOptions(qos0_drop_bytes=_LIMIT, sys_interval_s=0.05)
    with mqtt_server(tmp_path, options=options) as server:
        port = server.port("mqtt")
        slow = _slow_client(port)
        slow.connect("slow")
        slow.subscribe("slow/t", 0)
        watcher = Paho(port).connect()
        watcher.subscribe("$SYS/broker/publish/messages/dropped")
        publisher = Paho(port).connect()
        body = b"x" * _SIZE
        published = 0
        # Publish (the slow client reading nothing) until the server says it drops.
        while _dropped(watcher) == 0 and published < _MAX_PUBLISHED:
            for _ in range(_BATCH):
                publisher.publish("slow/t", body, 0, wait=False)
            published += _BATCH
            publisher.publish("sync/t", b"", 1)  # acked once the batch before it is routed
        assert _dropped(watcher) > 0, f"nothing dropped after {published} publishes"

        # Now read: every message is delivered or counted as dropped, none twice.
        slow.sock.settimeout(0.05)
        received = 0
        deadline = time.monotonic() + TIMEOUT
        while received + _dropped(watcher) != published:
            assert time.monotonic() < deadline, (received, _dropped(watcher), published)
            try:
                data = slow.sock.recv(1 << 16)
            except TimeoutError:
                continue
            assert data, "the server closed the slow client"
            received += sum(isinstance(p, codec.Publish) for p in slow.decoder.feed(data))
        assert 0 < received < published

        # Caught up: the drops are over, the next message arrives.
        slow.sock.settimeout(TIMEOUT)
        publisher.publish("slow/t", b"after", 0, wait=False)
        publisher.publish("sync/t", b"", 1)
        packet = slow.receive()
        assert isinstance(packet, codec.Publish) and packet.payload == b"after"
        for client in (publisher, watcher):
            client.disconnect()
        slow.close()
