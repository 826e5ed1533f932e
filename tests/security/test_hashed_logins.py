"""Real clients log in against a config that holds only hashes (docs/security.md):
confluent-kafka with SASL PLAIN and SCRAM-SHA-256/512, pika PLAIN, paho user name and
password, HTTP Basic on the admin API; MNS and RocketMQ keep signing with their access
keys. Wrong passwords get each protocol's own refusal, are counted on /metrics and
logged without the secret, and one address that keeps failing is answered later and
later. The credentials come from `polymq passwd` itself."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import argon2
import httpx
import pika
import pytest
from confluent_kafka import KafkaError, Producer
from pika.exceptions import ProbableAuthenticationError
from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.gateway.credentials import ScramKeys
from tests.kafka.clients import confluent_producer
from tests.live_server import LiveServer, live_server, server_config
from tests.mns.signed import request as mns_request
from tests.mqtt.helpers import Paho
from tests.rocketmq.conftest import raw_stub, signed

LISTENERS = ("kafka", "amqp", "mqtt", "rocketmq", "http")
PASSWORD = "pass-" + uuid.uuid4().hex  # unique: any occurrence in a log is a leak
WRONG = "wrong-" + uuid.uuid4().hex
# Cheap argon2id (the standard format, low cost) for the account tried most often.
_CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8192, parallelism=1)


def _passwd_lines(password: str) -> dict[str, str]:
    """What `polymq passwd --stdin` prints, parsed: the TOML keys and their strings."""
    out = subprocess.run(
        [sys.executable, "-m", "polymq.gateway", "passwd", "--stdin"],
        input=password + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = dict(re.findall(r'^(\w+) = "([^"]*)"$', out, re.MULTILINE))
    assert set(lines) == {"password_hash", "scram_sha_256", "scram_sha_512"}, out
    assert password not in out
    return lines


@pytest.fixture(scope="module")
def passwd() -> dict[str, str]:
    return _passwd_lines(PASSWORD)


def _accounts(passwd: dict[str, str]) -> AuthConfig:
    return AuthConfig(
        mode="accounts",
        accounts=(
            # Everything `polymq passwd` printed: every mechanism works.
            AccountConfig(
                user="full",
                namespaces=("sec",),
                password_hash=passwd["password_hash"],
                scram_sha_256=passwd["scram_sha_256"],
                scram_sha_512=passwd["scram_sha_512"],
            ),
            # Only an argon2id hash: PLAIN-style logins work, SCRAM cannot.
            AccountConfig(user="hashonly", password_hash=_CHEAP.hash(PASSWORD)),
            # Signed protocols need the secret itself (HMAC): unchanged.
            AccountConfig(
                user="signer",
                password_hash=_CHEAP.hash(PASSWORD),
                access_key="sec-ak",
                secret_key="sec-sk",
            ),
        ),
        # Small delays, so the slowdown shows within the test's patience.
        login_failures_free=1,
        login_failure_delay_ms=20,
        login_failure_max_delay_ms=80,
    )


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, server_form: str, passwd: dict[str, str]
) -> Iterator[LiveServer]:
    data_dir: Path = tmp_path_factory.mktemp("hashed-logins")
    config = dataclasses.replace(server_config(data_dir, LISTENERS), auth=_accounts(passwd))
    assert all(a.password is None for a in config.auth.accounts)  # nothing in clear
    with live_server(data_dir, LISTENERS, config=config) as s:
        yield s


def _http(server: LiveServer) -> str:
    host, port = server.address("http")
    return f"http://{host}:{port}"


def _failures(server: LiveServer) -> dict[str, float]:
    text = httpx.get(_http(server) + "/metrics", timeout=30).text
    return {
        m[0]: float(m[1])
        for m in re.findall(r'^polymq_login_failures_total\{protocol="(\w+)"\} (\S+)$', text, re.M)
    }


# -- Kafka -----------------------------------------------------------------------------


def _kafka(server: LiveServer, user: str, mechanism: str, password: str) -> dict[str, Any]:
    host, port = server.address("kafka")
    return {
        "bootstrap.servers": f"{host}:{port}",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": password,
    }


def _kafka_refusal(options: dict[str, Any]) -> KafkaError:
    """The first error a client trying to log in with ``options`` reports."""
    errors: list[KafkaError] = []
    producer = Producer(
        {**options, "error_cb": errors.append, "reconnect.backoff.ms": 1000, "retries": 0}
    )
    deadline = time.monotonic() + 30
    while not errors and time.monotonic() < deadline:
        producer.poll(0.05)
    assert errors, "no error reported"
    return errors[0]


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_kafka_logs_in_with_stored_keys(server: LiveServer, mechanism: str) -> None:
    options = _kafka(server, "full", mechanism, PASSWORD)
    producer = confluent_producer(options.pop("bootstrap.servers"), **options)
    producer.produce(f"sec-{uuid.uuid4().hex[:8]}", b"v")
    assert producer.flush(30) == 0


@pytest.mark.parametrize("user", ["full", "nobody"])
@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_kafka_wrong_password_is_refused(server: LiveServer, mechanism: str, user: str) -> None:
    refusal = _kafka_refusal(_kafka(server, user, mechanism, WRONG))
    assert refusal.code() == KafkaError._AUTHENTICATION, refusal
    assert "Authentication failed" in refusal.str()


def test_kafka_scram_needs_scram_keys_plain_needs_only_the_hash(server: LiveServer) -> None:
    options = _kafka(server, "hashonly", "PLAIN", PASSWORD)
    producer = confluent_producer(options.pop("bootstrap.servers"), **options)
    producer.produce(f"sec-{uuid.uuid4().hex[:8]}", b"v")
    assert producer.flush(30) == 0
    # The right password, but the account holds no SCRAM keys: a clean SASL failure.
    refusal = _kafka_refusal(_kafka(server, "hashonly", "SCRAM-SHA-256", PASSWORD))
    assert refusal.code() == KafkaError._AUTHENTICATION, refusal


# -- AMQP, MQTT, HTTP Basic ------------------------------------------------------------


def _pika(server: LiveServer, user: str, password: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1",
            server.port("amqp"),
            credentials=pika.PlainCredentials(user, password),
            connection_attempts=1,
        )
    )


def test_amqp_plain(server: LiveServer) -> None:
    with _pika(server, "full", PASSWORD) as connection:
        connection.channel().queue_declare(f"sec-{uuid.uuid4().hex[:8]}")
    with _pika(server, "hashonly", PASSWORD) as connection:
        assert connection.is_open
    with pytest.raises(ProbableAuthenticationError) as info:
        _pika(server, "full", WRONG)
    assert "ACCESS_REFUSED" in str(info.value)


@pytest.mark.parametrize("v5", [False, True])
def test_mqtt_user_and_password(server: LiveServer, v5: bool) -> None:
    good = Paho(server.port("mqtt"), v5=v5, username="full", password=PASSWORD).connect()
    try:
        assert good.connack == (False, 0)
    finally:
        good.client.loop_stop()
        good.client.disconnect()
    bad = Paho(server.port("mqtt"), v5=v5, username="full", password=WRONG).connect()
    try:  # v5: 0x86 bad user name or password; 3.1.1: return code 4, which paho
        assert bad.connack == (False, 0x86)  # reports as the same reason code
    finally:
        bad.client.loop_stop()


def test_admin_basic_auth(server: LiveServer) -> None:
    ok = httpx.get(_http(server) + "/admin/accounts", auth=("full", PASSWORD), timeout=30)
    assert ok.status_code == 200
    assert {a["user"]: a["has_password"] for a in ok.json()["accounts"]} == {"full": True}
    bad = httpx.get(_http(server) + "/admin/accounts", auth=("full", WRONG), timeout=30)
    assert bad.status_code == 401


# -- signed protocols: unchanged ---------------------------------------------------------


def test_mns_and_rocketmq_still_sign_with_the_access_key(server: LiveServer) -> None:
    base = _http(server)
    ok = mns_request(base, "GET", "/queues", access_key="sec-ak", secret_key="sec-sk")
    assert ok.status_code == 200, ok.text
    bad = mns_request(base, "GET", "/queues", access_key="sec-ak", secret_key="not-it")
    assert bad.status_code == 403, bad.text
    request = service_pb2.QueryRouteRequest(topic=definition_pb2.Resource(name="sec-t"))
    with raw_stub(server) as stub:
        good = stub.QueryRoute(request, metadata=signed(ak="sec-ak", sk="sec-sk"))
        assert good.status.code != Code.UNAUTHORIZED
        wrong = stub.QueryRoute(request, metadata=signed(ak="sec-ak", sk="not-it"))
        assert wrong.status.code == Code.UNAUTHORIZED


# -- failed logins: counted, logged without the secret, slowed down ------------------------


def test_failures_are_counted_and_logged_without_the_secret(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    before = _failures(server)
    with caplog.at_level(logging.INFO):
        with pytest.raises(ProbableAuthenticationError):
            _pika(server, "full", WRONG)
        bad = Paho(server.port("mqtt"), username="hashonly", password=WRONG).connect()
        bad.client.loop_stop()
        _kafka_refusal(_kafka(server, "full", "PLAIN", WRONG))
        _kafka_refusal(_kafka(server, "full", "SCRAM-SHA-512", WRONG))
        httpx.get(_http(server) + "/admin/accounts", auth=("hashonly", WRONG), timeout=30)
        with _pika(server, "full", PASSWORD):
            pass
    after = _failures(server)
    grew = {p: after.get(p, 0) - before.get(p, 0) for p in ("amqp", "mqtt", "kafka", "http")}
    # confluent-kafka may try again before it is closed: at least one per client.
    assert grew["amqp"] == 1 and grew["mqtt"] == 1 and grew["http"] == 1, grew
    assert grew["kafka"] >= 2, grew
    logged = caplog.text
    assert "protocol=amqp user='full' peer=127.0.0.1:" in logged
    assert "protocol=mqtt user='hashonly'" in logged
    assert "protocol=kafka user='full'" in logged
    assert WRONG not in logged and PASSWORD not in logged


def test_one_address_failing_again_and_again_is_slowed_down(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    with _pika(server, "full", PASSWORD):  # a success forgets earlier failures
        pass
    with caplog.at_level(logging.WARNING, logger="polymq.gateway.login_guard"):
        for _ in range(4):
            bad = Paho(server.port("mqtt"), username="full", password=WRONG).connect()
            bad.client.loop_stop()
            assert bad.connack == (False, 0x86)
    lines = [r.getMessage() for r in caplog.records if "login failed" in r.getMessage()]
    streak = [int(m) for line in lines for m in re.findall(r"\((\d+) in a row", line)]
    delays = [int(m.group(1)) if (m := re.search(r"after (\d+) ms", line)) else 0 for line in lines]
    assert streak == [1, 2, 3, 4], lines
    assert delays == [0, 20, 40, 80], lines  # free, then doubling up to the cap
    with _pika(server, "full", PASSWORD):
        pass


def test_scram_keys_from_passwd_are_the_password(passwd: dict[str, str]) -> None:
    keys = ScramKeys.parse("SCRAM-SHA-512", passwd["scram_sha_512"])
    assert keys.matches(PASSWORD) and not keys.matches(WRONG)
