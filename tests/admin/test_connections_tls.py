"""What ``/admin/connections`` (and so the console's connections page) says of TLS,
against real pika connections: one over ``amqps`` with a client certificate (EXTERNAL:
its CN is the account), one in plaintext over ``amqp``. The merged form only: the
listeners, not storage, know TLS."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import pika
import pytest
from pika.credentials import ExternalCredentials

from tests.live_server import LiveServer
from tests.tls.conftest import NAMESPACE, PASSWORD, USER, Certs, make_certs, tls_server

ONE_FORM = True
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Certs]]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    with tls_server(tmp_path_factory.mktemp("data"), certs, ("http", "amqp", "amqps")) as s:
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
    host, port = server.address("http")
    answer = httpx.get(
        f"http://{host}:{port}/admin/connections", auth=(USER, PASSWORD), timeout=TIMEOUT_S
    )
    entries: list[dict[str, Any]] = answer.json()["connections"]
    [entry] = [c for c in entries if c["peer"] == peer]
    return entry


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
