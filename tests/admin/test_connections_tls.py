"""What ``/admin/connections`` (and so the console's connections page) says of TLS
and traffic, against real clients: pika over ``amqps`` with a client certificate
(EXTERNAL: its CN is the account) and in plaintext over ``amqp``; a pika publisher and
a pika consumer, each credited with its own messages; MQTT publishes counted for the
publisher, and MQTT deliveries for no connection (they run in the publisher's task:
``OUT_NOT_PER_CONNECTION``). The merged form only: the listeners, not storage, know
TLS and count per connection."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import paho.mqtt.client as mqtt
import pika
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from pika.credentials import ExternalCredentials

from tests.live_server import LiveServer
from tests.tls.conftest import NAMESPACE, PASSWORD, USER, Certs, make_certs, tls_server

ONE_FORM = True
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Certs]]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    with tls_server(tmp_path_factory.mktemp("data"), certs, ("http", "amqp", "amqps", "mqtt")) as s:
        yield s, certs


def connection(server: LiveServer, listener: str, **options: Any) -> pika.BlockingConnection:
    host, port = server.address(listener)
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            host=host, port=port, virtual_host=NAMESPACE, socket_timeout=TIMEOUT_S, **options
        )
    )


def listed(server: LiveServer, conn: pika.BlockingConnection) -> dict[str, Any]:
    """The admin API's entry for pika's connection (found by its local address)."""
    peer = "{}:{}".format(*conn._impl._transport._sock.getsockname())
    [entry] = [c for c in connections(server) if c["peer"] == peer]
    return entry


def connections(server: LiveServer) -> list[dict[str, Any]]:
    host, port = server.address("http")
    answer = httpx.get(
        f"http://{host}:{port}/admin/connections", auth=(USER, PASSWORD), timeout=TIMEOUT_S
    )
    entries: list[dict[str, Any]] = answer.json()["connections"]
    return entries


def test_tls_and_the_certificates_principal(served: tuple[LiveServer, Certs]) -> None:
    server, certs = served
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(certs.client_chain, certs.client_key)
    secure = connection(
        server, "amqps", credentials=ExternalCredentials(), ssl_options=pika.SSLOptions(context)
    )
    plain = connection(server, "amqp", credentials=pika.PlainCredentials(USER, PASSWORD))
    try:
        over_tls, in_clear = listed(server, secure), listed(server, plain)
    finally:
        secure.close()
        plain.close()
    assert (over_tls["tls"], over_tls["certificate"], over_tls["user"]) == (True, USER, USER)
    assert (in_clear["tls"], in_clear["certificate"], in_clear["user"]) == (False, None, USER)


def traffic(entry: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(entry[k] for k in ("messages_in", "bytes_in", "messages_out", "bytes_out"))


def test_a_publisher_and_a_consumer_each_counted_for_their_own(
    served: tuple[LiveServer, Certs],
) -> None:
    server, _ = served
    login = pika.PlainCredentials(USER, PASSWORD)
    consumer, publisher = connection(server, "amqp", credentials=login), None
    try:
        channel = consumer.channel()
        channel.queue_declare("counted")
        got: list[bytes] = []
        channel.basic_consume("counted", lambda c, m, p, body: got.append(body), auto_ack=True)
        publisher = connection(server, "amqp", credentials=login)
        sending = publisher.channel()
        sending.confirm_delivery()
        for body in (b"one", b"two", b"three"):
            sending.basic_publish("", "counted", body)
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) < 3:
            assert time.monotonic() < deadline
            consumer.process_data_events(time_limit=0.2)
        assert traffic(listed(server, publisher)) == (3, 11, 0, 0)
        assert traffic(listed(server, consumer)) == (0, 0, 3, 11)
    finally:
        consumer.close()
        if publisher is not None:
            publisher.close()


def test_mqtt_publishes_counted_for_the_publisher(served: tuple[LiveServer, Certs]) -> None:
    server, _ = served
    host, port = server.address("mqtt")
    clients = []
    received: list[bytes] = []
    for client_id in ("watcher", "talker"):
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
        client.username_pw_set(USER, PASSWORD)
        client.connect(host, port)
        client.loop_start()
        clients.append(client)
    watcher, talker = clients
    try:
        both = threading.Event()

        def on_message(client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
            received.append(bytes(message.payload))
            if len(received) == 2:
                both.set()

        watcher.on_message = on_message
        acknowledged = threading.Event()  # the SUBACK: publishes then reach the watcher
        watcher.on_subscribe = lambda *args: acknowledged.set()
        watcher.subscribe("news/#", qos=1)
        assert acknowledged.wait(TIMEOUT_S)
        for body in (b"a", b"bb"):
            talker.publish("news/x", body, qos=1).wait_for_publish(TIMEOUT_S)
        assert both.wait(TIMEOUT_S) and received == [b"a", b"bb"]
        by_id = {c["client_id"]: c for c in connections(server)}
        assert traffic(by_id["talker"]) == (2, 3, None, None)
        assert traffic(by_id["watcher"]) == (None, None, None, None)
    finally:
        for client in clients:
            client.loop_stop()
            client.disconnect()
