"""MQTT: the permission model's refusals as MQTT says them, seen by paho v3.1.1 and v5:
SUBACK 0x80 (v3) / 0x87 (v5), PUBACK 0x87 (v5; v3 acknowledges and drops, as
Mosquitto), CONNACK 0x87 (v5) / 5 (v3) for a will the account may not publish; a
tenant's wildcard subscription sees nothing of another namespace."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho
from tests.permissions.accounts import PASSWORD, permission_server

NOT_AUTHORIZED_V5 = 0x87
FAILURE_V3 = 0x80


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with permission_server(tmp_path_factory.mktemp("perm-mqtt"), ("mqtt",)) as s:
        yield s


def _client(server: LiveServer, user: str, *, v5: bool, **extra: object) -> Paho:
    return Paho(server.port("mqtt"), v5=v5, username=user, password=PASSWORD, **extra)  # type: ignore[arg-type]


def _topic() -> str:
    return f"data-{uuid.uuid4().hex[:8]}"


def test_v5_reader_subscribes_and_may_not_publish(server: LiveServer) -> None:
    topic = _topic()
    reader = _client(server, "reader", v5=True).connect()
    writer = _client(server, "writer", v5=True).connect()
    try:
        assert reader.connack == (False, 0)
        assert reader.subscribe(f"{topic}/#", qos=1) == [1]
        assert reader.subscribe("secret/#", qos=1) == [NOT_AUTHORIZED_V5]
        assert reader.subscribe("#", qos=1) == [NOT_AUTHORIZED_V5]  # every name: not allowed
        assert reader.publish(f"{topic}/a", b"nope", qos=1) == NOT_AUTHORIZED_V5
        assert writer.publish(f"{topic}/a", b"yes", qos=1) == 0
        assert [m.payload for m in reader.wait_messages(1)] == [b"yes"]
        assert writer.subscribe(f"{topic}/#", qos=1) == [NOT_AUTHORIZED_V5]
    finally:
        reader.disconnect()
        writer.disconnect()


def test_v3_refused_subscription_and_dropped_publish(server: LiveServer) -> None:
    topic = _topic()
    reader = _client(server, "reader", v5=False).connect()
    writer = _client(server, "writer", v5=False).connect()
    try:
        assert reader.subscribe(f"{topic}/#", qos=1) == [1]
        assert reader.subscribe("secret/#", qos=1) == [FAILURE_V3]
        assert reader.publish(f"{topic}/a", b"dropped", qos=1) == 0  # acknowledged, dropped
        assert writer.publish(f"{topic}/a", b"kept", qos=1) == 0
        assert [m.payload for m in reader.wait_messages(1)] == [b"kept"]
        assert writer.subscribe(f"{topic}/#", qos=1) == [FAILURE_V3]
    finally:
        reader.disconnect()
        writer.disconnect()


@pytest.mark.parametrize("v5", [True, False])
def test_a_will_the_account_may_not_publish_is_refused_at_connect(
    server: LiveServer, v5: bool
) -> None:
    client = _client(server, "reader", v5=v5, will=("secret/will", b"bye", 0, False))
    try:
        client.connect()
        # paho reports v3's return code 5 (not authorized) as v5's 0x87.
        assert client.connack is not None and client.connack[1] == NOT_AUTHORIZED_V5
    finally:
        client.kill()


def test_a_wildcard_subscription_sees_nothing_of_another_namespace(server: LiveServer) -> None:
    topic = _topic()
    outsider = _client(server, "outsider", v5=True).connect()
    writer = _client(server, "writer", v5=True).connect()
    try:
        assert outsider.subscribe("#", qos=1) == [1]
        assert writer.publish(f"{topic}/a", b"shop only", qos=1) == 0
        assert outsider.publish("marker/x", b"marker", qos=1) == 0
        received = outsider.wait_messages(1)
        assert [m.payload for m in received] == [b"marker"]
    finally:
        outsider.disconnect()
        writer.disconnect()
