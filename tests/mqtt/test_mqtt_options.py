"""The adapter's tunables (protocols/mqtt/options.py): Server Keep Alive and the
``$SYS`` interval, with short values so nothing waits long."""

from __future__ import annotations

from pathlib import Path

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.options import MqttOptions
from tests.mqtt.helpers import Paho, RawClient, mqtt_server


def test_server_keep_alive_caps_the_clients_and_is_enforced(tmp_path: Path) -> None:
    with mqtt_server(tmp_path, options=MqttOptions(max_keep_alive_s=1)) as server:
        port = server.port("mqtt")
        long = RawClient(port)
        ack = long.connect("long", keep_alive=600)
        assert ack.properties[codec.SERVER_KEEP_ALIVE] == 1
        short = RawClient(port)
        ack = short.connect("short", keep_alive=1)
        assert codec.SERVER_KEEP_ALIVE not in ack.properties  # within the cap: as asked
        none = RawClient(port)
        ack = none.connect("none", keep_alive=0)  # no keep-alive: capped too
        assert ack.properties[codec.SERVER_KEEP_ALIVE] == 1
        # silent past 1.5 x the server's keep-alive: closed with reason 0x8D
        packets = none.closed()
        assert isinstance(packets[-1], codec.Disconnect) and packets[-1].reason == 0x8D
        v3 = RawClient(port, codec.LEVEL_311)
        ack = v3.connect("v3", keep_alive=600)
        assert ack.properties == {}  # v3 has no Server Keep Alive: its own value holds
        for client in (long, short, v3):
            client.close()


def test_sys_topics_are_sent_every_interval(tmp_path: Path) -> None:
    with mqtt_server(tmp_path, options=MqttOptions(sys_interval_s=0.1)) as server:
        client = Paho(server.port("mqtt")).connect()
        client.subscribe("$SYS/broker/clients/connected")
        got = client.wait_messages(3)
        assert got[0].retain  # the current value on subscribe
        assert [(m.payload, m.retain) for m in got[1:3]] == [(b"1", False)] * 2  # periodic


def test_keep_alive_is_not_capped_when_the_option_is_0(tmp_path: Path) -> None:
    with mqtt_server(tmp_path, options=MqttOptions(max_keep_alive_s=0)) as server:
        raw = RawClient(server.port("mqtt"))
        ack = raw.connect("free", keep_alive=0)
        assert codec.SERVER_KEEP_ALIVE not in ack.properties
        raw.close()
