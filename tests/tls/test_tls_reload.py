"""Certificate reload without a restart: the server's files are replaced and the
reload SIGHUP calls (``Gateway.reload_tls``) is run; a new connection on every kind
of TLS listener (asyncio's, websockets', uvicorn's, grpc's) gets the new certificate,
a connection opened before carries on, and a bad file changes nothing."""

from __future__ import annotations

import shutil
import socket
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from polymq.gateway.config import ConfigError
from tests.live_server import LiveServer
from tests.tls.conftest import Certs, tls_server, write_cert
from tests.tls.test_tls_mqtt import tls_paho

LISTENERS = ("kafka_tls", "mqtts", "mqtt_wss", "rocketmq_tls", "https")
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, server_form: str
) -> Iterator[tuple[LiveServer, Path, Path]]:
    """The server over copies of the certificate files, which the test replaces."""
    folder = tmp_path_factory.mktemp("reloaded")
    chain, key = folder / "server.pem", folder / "server.key"
    shutil.copy(certs.server_chain, chain)
    shutil.copy(certs.server_key, key)
    data_dir = folder / "data"
    overrides = {"tls.cert_file": str(chain), "tls.key_file": str(key)}
    with tls_server(data_dir, certs, LISTENERS, **overrides) as s:
        yield s, chain, key


def _served_certificate(server: LiveServer, listener: str, certs: Certs) -> bytes:
    context = ssl.create_default_context(cafile=str(certs.ca))
    with (
        socket.create_connection(server.address(listener), TIMEOUT_S) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _reload(server: LiveServer) -> None:
    async def reload() -> None:
        server.gateway.reload_tls()

    server.call(reload)


def test_reload_serves_the_new_certificate_to_new_connections(
    served: tuple[LiveServer, Path, Path], certs: Certs
) -> None:
    server, chain, key = served
    before = {name: _served_certificate(server, name, certs) for name in LISTENERS}
    assert len(set(before.values())) == 1
    topic = f"reload/{uuid.uuid4().hex[:8]}"
    survivor = tls_paho(server, certs, "mqtts")
    try:
        assert survivor.subscribe(topic, qos=1) == [1]

        fresh = certs.authority.issue_cert("127.0.0.1", "localhost")
        assert write_cert(chain.parent, "server", fresh) == (chain, key)
        _reload(server)

        after = {name: _served_certificate(server, name, certs) for name in LISTENERS}
        assert all(after[name] != before[name] for name in LISTENERS), after
        survivor.publish(topic, b"still here", qos=1)
        assert [m.payload for m in survivor.wait_messages(1)] == [b"still here"]
    finally:
        survivor.disconnect()

    # A broken file: the reload fails and the certificate just loaded serves on.
    key.write_text("not a key")
    with pytest.raises(ConfigError):
        _reload(server)
    assert _served_certificate(server, "mqtts", certs) == after["mqtts"]
