"""Other clients drive the same flows: gmqtt and amqtt (asyncio), mqtt.js from node
over TCP and WebSocket, and paho over WebSocket."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.mqtt.helpers import TIMEOUT, Paho, mqtt_server

NODE_DIR = Path(__file__).resolve().parents[1] / "nodejs"


async def test_gmqtt_v5_and_v311(tmp_path: Path) -> None:
    from gmqtt import Client
    from gmqtt.mqtt.constants import MQTTv50, MQTTv311

    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        for version in (MQTTv311, MQTTv50):
            received: asyncio.Queue[tuple[str, bytes, int]] = asyncio.Queue()
            subscribed = asyncio.Event()
            sub = Client(f"gsub-{version}")
            sub.on_message = _collect_into(received)
            sub.on_subscribe = lambda *args, event=subscribed: event.set()
            await sub.connect("127.0.0.1", port, version=version)
            sub.subscribe("g/#", qos=2)
            pub = Client(f"gpub-{version}")
            await pub.connect("127.0.0.1", port, version=version)
            await asyncio.wait_for(subscribed.wait(), TIMEOUT)  # gmqtt does not wait for SUBACK
            for qos in (0, 1, 2):
                pub.publish(f"g/{qos}", f"m{qos}".encode(), qos=qos)
            got = [await asyncio.wait_for(received.get(), TIMEOUT) for _ in range(3)]
            assert sorted(got) == [("g/0", b"m0", 0), ("g/1", b"m1", 1), ("g/2", b"m2", 2)]
            await pub.disconnect()
            await sub.disconnect()


def _collect_into(queue: asyncio.Queue[tuple[str, bytes, int]]) -> Any:
    def on_message(client: object, topic: str, payload: bytes, qos: int, props: object) -> int:
        queue.put_nowait((topic, payload, qos))
        return 0

    return on_message


async def test_amqtt_client(tmp_path: Path) -> None:
    from amqtt.client import MQTTClient
    from amqtt.mqtt.constants import QOS_1, QOS_2

    with mqtt_server(tmp_path) as server:
        uri = f"mqtt://127.0.0.1:{server.port('mqtt')}/"
        sub = MQTTClient(client_id="amqtt-sub")
        await sub.connect(uri)
        await sub.subscribe([("am/#", QOS_2)])
        pub = MQTTClient(client_id="amqtt-pub")
        await pub.connect(uri)
        await pub.publish("am/one", b"1", qos=QOS_1)
        await pub.publish("am/two", b"2", qos=QOS_2, retain=True)
        got = []
        for _ in range(2):
            message = await sub.deliver_message(timeout_duration=TIMEOUT)
            assert message is not None
            got.append((message.topic, bytes(message.data)))
        assert sorted(got) == [("am/one", b"1"), ("am/two", b"2")]
        late = MQTTClient(client_id="amqtt-late")
        await late.connect(uri)
        await late.subscribe([("am/+", QOS_1)])
        message = await late.deliver_message(timeout_duration=TIMEOUT)
        assert message is not None and (message.topic, bytes(message.data)) == ("am/two", b"2")
        for client in (pub, sub, late):
            await client.disconnect()


def _node(script: str, *args: str) -> dict[str, object]:
    result = subprocess.run(
        ["node", str(NODE_DIR / script), *args],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("transport", ["mqtt", "ws"])
@pytest.mark.parametrize("version", ["4", "5"])
def test_mqtt_js(tmp_path: Path, transport: str, version: str) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt" if transport == "mqtt" else "mqtt_ws")
        result = _node("mqtt_roundtrip.js", f"{transport}://127.0.0.1:{port}/mqtt", version)
        assert result["received"] == [["js/0", "q0", 0], ["js/1", "q1", 1], ["js/2", "q2", 2]]
        assert result["retained"] == ["js/keep", "kept", True]
        if version == "5":
            assert result["userProperties"] == {"k": "v"}


def test_paho_over_websocket(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        ws_port = server.port("mqtt_ws")
        sub = Paho(ws_port, v5=True, transport="websockets").connect()
        sub.subscribe("ws/#", qos=1)
        tcp = Paho(server.port("mqtt")).connect()
        tcp.publish("ws/from-tcp", b"a", qos=1)
        sub.publish("ws/from-ws", b"b" * 70000, qos=1)
        got = sub.wait_messages(2)
        assert sorted((m.topic, len(m.payload)) for m in got) == [
            ("ws/from-tcp", 1),
            ("ws/from-ws", 70000),
        ]
        sub.disconnect()


def test_takeover_across_tcp_and_websocket(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        first = Paho(server.port("mqtt"), v5=True, client_id="roamer", session_expiry=60)
        first.client.reconnect_delay_set(60, 120)  # no automatic reconnect during the test
        first.connect()
        first.subscribe("roam/#", qos=1)
        second = Paho(
            server.port("mqtt_ws"),
            v5=True,
            client_id="roamer",
            session_expiry=60,
            transport="websockets",
        )
        second.connect(clean_start=False)
        first.wait(lambda: bool(first.disconnects), "takeover")
        assert first.disconnects[0] == 0x8E
        assert second.connack == (True, 0)
        Paho(server.port("mqtt")).connect().publish("roam/x", b"here", qos=1)
        assert [m.payload for m in second.wait_messages(1)] == [b"here"]
