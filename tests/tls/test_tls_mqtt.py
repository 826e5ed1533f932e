"""MQTTS (``mqtts``) and MQTT over WSS (``mqtt_wss``): paho with a password over TLS
and with a client certificate as its identity (Mosquitto's use_identity_as_username:
no user name given, the CN is the account), paho over WSS, and mqtt.js over mqtts
and wss (node trusts the test CA through NODE_EXTRA_CA_CERTS)."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho
from tests.tls.conftest import PASSWORD, USER, Certs, tls_server

NODE_DIR = Path(__file__).resolve().parents[1] / "nodejs"


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, server_form: str
) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("mqtts")
    with tls_server(data_dir, certs, ("mqtt", "mqtts", "mqtt_wss")) as s:
        yield s


def tls_paho(server: LiveServer, certs: Certs, listener: str, *, certificate: bool = False) -> Paho:
    """A connected paho client over TLS: with the client certificate and no user
    name, or with the account's password."""
    transport = "websockets" if listener == "mqtt_wss" else "tcp"
    if certificate:
        client = Paho(server.port(listener), transport=transport)
    else:
        client = Paho(server.port(listener), transport=transport, username=USER, password=PASSWORD)
    context = ssl.create_default_context(cafile=str(certs.ca))
    if certificate:
        context.load_cert_chain(certs.client_chain, certs.client_key)
    client.client.tls_set_context(context)
    return client.connect()


@pytest.mark.parametrize("listener", ["mqtts", "mqtt_wss"])
def test_paho_certificate_identity_reaches_password_subscriber(
    server: LiveServer, certs: Certs, listener: str
) -> None:
    """The certificate's client publishes without a user name; a subscriber that
    logged in with alice's password (same namespace) receives it."""
    topic = f"tls/{uuid.uuid4().hex[:8]}"
    subscriber = tls_paho(server, certs, listener)
    publisher = tls_paho(server, certs, listener, certificate=True)
    try:
        assert subscriber.connack == (False, 0) and publisher.connack == (False, 0)
        assert subscriber.subscribe(topic, qos=1) == [1]
        publisher.publish(topic, b"by certificate", qos=1)
        got = subscriber.wait_messages(1)
    finally:
        publisher.disconnect()
        subscriber.disconnect()
    assert (got[0].topic, got[0].payload) == (topic, b"by certificate")


@pytest.mark.parametrize("scheme,listener", [("mqtts", "mqtts"), ("wss", "mqtt_wss")])
def test_mqtt_js_over_tls(server: LiveServer, certs: Certs, scheme: str, listener: str) -> None:
    url = f"{scheme}://{USER}:{PASSWORD}@127.0.0.1:{server.port(listener)}/mqtt"
    result = subprocess.run(
        ["node", str(NODE_DIR / "mqtt_roundtrip.js"), url, "4"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NODE_EXTRA_CA_CERTS": str(certs.ca)},
    )
    cleaner = tls_paho(server, certs, "mqtts")  # the script's retained message goes
    try:
        cleaner.publish("js/keep", b"", qos=1, retain=True)
    finally:
        cleaner.disconnect()
    assert result.returncode == 0, result.stderr + result.stdout
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["received"] == [["js/0", "q0", 0], ["js/1", "q1", 1], ["js/2", "q2", 2]]
    assert reply["retained"] == ["js/keep", "kept", True]
