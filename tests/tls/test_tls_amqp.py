"""AMQPS (``amqps``): pika and aio-pika with a password over TLS, pika with the
EXTERNAL mechanism and a client certificate (RabbitMQ's rabbitmq_auth_mechanism_ssl:
the CN is the user); EXTERNAL without a certificate is refused."""

from __future__ import annotations

import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pika
import pytest
from pika.credentials import ExternalCredentials

from tests.live_server import LiveServer
from tests.tls.conftest import PASSWORD, USER, Certs, tls_server

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, server_form: str
) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("amqps")
    with tls_server(data_dir, certs, ("amqp", "amqps")) as s:
        yield s


def client_context(certs: Certs, *, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if with_certificate:
        context.load_cert_chain(certs.client_chain, certs.client_key)
    return context


def _params(
    server: LiveServer, certs: Certs, credentials: object, *, with_certificate: bool
) -> pika.ConnectionParameters:
    host, port = server.address("amqps")
    return pika.ConnectionParameters(
        host=host,
        port=port,
        credentials=credentials,
        ssl_options=pika.SSLOptions(client_context(certs, with_certificate=with_certificate)),
        blocked_connection_timeout=TIMEOUT_S,
        socket_timeout=TIMEOUT_S,
    )


def _round_trip(params: pika.ConnectionParameters) -> bytes | None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    with pika.BlockingConnection(params) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare(queue)
        channel.basic_publish("", queue, b"over amqps")
        for _method, _props, body in channel.consume(queue, inactivity_timeout=TIMEOUT_S):
            channel.cancel()
            return bytes(body)
    return None


def test_pika_password_over_tls(server: LiveServer, certs: Certs) -> None:
    params = _params(server, certs, pika.PlainCredentials(USER, PASSWORD), with_certificate=False)
    assert _round_trip(params) == b"over amqps"


def test_pika_external_with_a_client_certificate(server: LiveServer, certs: Certs) -> None:
    params = _params(server, certs, ExternalCredentials(), with_certificate=True)
    assert _round_trip(params) == b"over amqps"


def test_external_without_a_certificate_is_refused(server: LiveServer, certs: Certs) -> None:
    params = _params(server, certs, ExternalCredentials(), with_certificate=False)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(params)


async def test_aio_pika_over_tls(server: LiveServer, certs: Certs) -> None:
    host, port = server.address("amqps")
    connection = await aio_pika.connect(
        host=host,
        port=port,
        login=USER,
        password=PASSWORD,
        ssl=True,
        ssl_context=client_context(certs, with_certificate=False),
        timeout=TIMEOUT_S,
    )
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"aq-{uuid.uuid4().hex[:8]}")
        await channel.default_exchange.publish(aio_pika.Message(b"aio amqps"), queue.name)
        message = await queue.get(timeout=TIMEOUT_S)
        await message.ack()
    assert message.body == b"aio amqps"
