"""Refusals on a TLS listener (MQTTS): a client that does not trust our CA, a client
certificate from a CA we do not trust, an expired client certificate, and a plaintext
MQTT CONNECT on the TLS port each end that one socket, cleanly, while a connection
already open on the listener keeps working (a round trip before and after) and no
refused socket is left in the connection registry."""

from __future__ import annotations

import socket
import ssl
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from polymq.protocols.mqtt import codec
from tests.live_server import LiveServer
from tests.tls.conftest import Certs, tls_server
from tests.tls.test_tls_mqtt import tls_paho

TIMEOUT_S = 20.0
_CONNECT = codec.encode(codec.Connect(client_id="refused", level=codec.LEVEL_311), codec.LEVEL_311)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, server_form: str
) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("tls-refusals")
    with tls_server(data_dir, certs, ("mqtts",)) as s:
        yield s


def _connections(server: LiveServer) -> int:
    async def count() -> int:
        return len(server.gateway.connections)

    return server.call(count)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _closed_by_server(tls: ssl.SSLSocket) -> bool:
    """Whether the server ended this TLS connection (an alert, or the socket closed)
    instead of serving it: TLS 1.3 clients learn of a refused certificate on their
    first read."""
    tls.settimeout(TIMEOUT_S)
    try:
        tls.sendall(_CONNECT)
        return tls.recv(64) == b""
    except (ssl.SSLError, ConnectionError):
        return True


def _client(certs: Certs, *, trust: Path, chain: Path | None, key: Path | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(trust))
    if chain is not None:
        context.load_cert_chain(chain, key)
    return context


def test_refused_handshakes_leave_the_listener_serving(server: LiveServer, certs: Certs) -> None:
    topic = f"keep/{uuid.uuid4().hex[:8]}"
    address = server.address("mqtts")
    survivor = tls_paho(server, certs, "mqtts")
    try:
        assert survivor.subscribe(topic, qos=1) == [1]
        survivor.publish(topic, b"before", qos=1)
        survivor.wait_messages(1, "the round trip before")
        baseline = _connections(server)
        assert baseline >= 1  # the TLS connection counts in the gateway's registry

        # 1. The client does not trust the server's CA: it refuses the handshake.
        wrong_ca = _client(certs, trust=certs.other_ca, chain=None, key=None)
        with (
            socket.create_connection(address, TIMEOUT_S) as raw,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            wrong_ca.wrap_socket(raw, server_hostname="127.0.0.1")

        # 2. and 3. Client certificates the server refuses: from an untrusted CA, expired.
        for chain, key in (
            (certs.stranger_chain, certs.stranger_key),
            (certs.expired_chain, certs.expired_key),
        ):
            context = _client(certs, trust=certs.ca, chain=chain, key=key)
            with socket.create_connection(address, TIMEOUT_S) as raw:
                try:
                    tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
                except (ssl.SSLError, ConnectionError):
                    continue  # refused within the handshake (TLS 1.2)
                with tls:
                    assert _closed_by_server(tls), f"{chain.name} was served"

        # 4. Plaintext MQTT on the TLS port: closed without an MQTT answer.
        with socket.create_connection(address, TIMEOUT_S) as raw:
            raw.settimeout(TIMEOUT_S)
            raw.sendall(_CONNECT)
            try:
                answer = raw.recv(64)
                while answer and not answer.startswith(b"\x15"):  # a TLS alert record
                    answer = raw.recv(64)
            except ConnectionError:
                answer = b""
            assert not answer.startswith(b"\x20")  # never a CONNACK

        _wait_for(lambda: _connections(server) == baseline, "refused sockets to leave")
        survivor.publish(topic, b"after", qos=1)
        got = survivor.wait_messages(2, "the round trip after")
    finally:
        survivor.disconnect()
    assert [m.payload for m in got] == [b"before", b"after"]
