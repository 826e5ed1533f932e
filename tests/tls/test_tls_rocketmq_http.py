"""gRPC over TLS (``rocketmq_tls``) with rocketmq-python-client's ``tls_enable`` and
HTTPS (``https``) with httpx, curl and the MNS SDK: the MNS API, ``/metrics`` and
``/healthz`` over TLS."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mns.account import Account
from mns.queue import Message, QueueMeta

from tests.live_server import LiveServer
from tests.tls.conftest import ACCESS_KEY, NAMESPACE, SECRET_KEY, Certs, tls_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, certs: Certs, server_form: str
) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("grpc-https")
    with tls_server(data_dir, certs, ("rocketmq", "rocketmq_tls", "http", "https")) as s:
        yield s


def test_rocketmq_client_with_tls_enable(server: LiveServer, certs: Certs) -> None:
    topic = f"tls-{uuid.uuid4().hex[:8]}"
    endpoint = f"127.0.0.1:{server.port('rocketmq_tls')}"
    credentials = (ACCESS_KEY, SECRET_KEY, NAMESPACE)
    result = subprocess.run(
        [sys.executable, "-m", "tests.tls.rocketmq_tls_client", endpoint, *credentials, topic],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(certs.ca)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply == {"sent": True, "received": ["over grpc tls"]}


def test_httpx_and_curl_over_https(server: LiveServer, certs: Certs) -> None:
    base = f"https://127.0.0.1:{server.port('https')}"
    verify = ssl.create_default_context(cafile=str(certs.ca))
    with httpx.Client(verify=verify, timeout=30) as client:
        assert client.get(f"{base}/healthz").status_code == 200
        assert "polymq" in client.get(f"{base}/metrics").text
    ca = str(certs.ca)
    curl = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", ca, f"{base}/healthz"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert curl.stdout == "200", curl.stderr
    refused = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", f"{base}/healthz"],  # the system CAs only
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 60  # peer certificate cannot be authenticated


def test_mns_sdk_over_https(
    server: LiveServer, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK's HTTPSConnection uses Python's default context: OpenSSL's default
    # verify paths, which SSL_CERT_FILE names.
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
    account = Account(f"https://127.0.0.1:{server.port('https')}", ACCESS_KEY, SECRET_KEY)
    queue = account.get_queue(f"tls-{uuid.uuid4().hex[:8]}")
    queue.create(QueueMeta())
    queue.send_message(Message("over https"))
    received = queue.receive_message(5)
    queue.delete_message(received.receipt_handle)
    body = received.message_body
    assert (body.decode() if isinstance(body, bytes) else body) == "over https"
