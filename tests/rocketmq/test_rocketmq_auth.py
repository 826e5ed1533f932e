"""AK/SK request signatures and resource namespaces."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.gateway.processor import Caller
from tests.live_server import LiveServer, live_server, server_config
from tests.rocketmq.conftest import (
    factory,
    message,
    producer,
    raw_stub,
    receive_all,
    signed,
    simple_consumer,
    unique,
)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[LiveServer]:
    config = server_config(tmp_path, ("rocketmq",))
    accounts = (
        AccountConfig(
            user="alice", access_key="AK-alice", secret_key="SK-alice", namespaces=("ns-a",)
        ),
        AccountConfig(user="bob", access_key="AK-bob", secret_key="SK-bob", namespaces=("ns-b",)),
    )
    config = dataclasses.replace(config, auth=AuthConfig(mode="accounts", accounts=accounts))
    with live_server(
        tmp_path, ("rocketmq",), config=config, factories={"rocketmq": factory()}
    ) as live:
        yield live


def route(stub: Any, topic: str, metadata: list[tuple[str, str]]) -> int:
    request = service_pb2.QueryRouteRequest(topic=definition_pb2.Resource(name=topic))
    return int(stub.QueryRoute(request, metadata=metadata).status.code)


def test_signatures_checked(secured: LiveServer) -> None:
    with raw_stub(secured) as stub:
        assert route(stub, "t", signed(ak="AK-alice", sk="SK-alice")) == Code.OK
        assert route(stub, "t", signed(ak="AK-alice", sk="wrong")) == Code.UNAUTHORIZED
        assert route(stub, "t", signed(ak="AK-nobody", sk="SK-alice")) == Code.UNAUTHORIZED
        assert route(stub, "t", [("x-mq-client-id", "c")]) == Code.UNAUTHORIZED
        garbled = [("authorization", "Basic abc"), ("x-mq-date-time", "20250101T000000Z")]
        assert route(stub, "t", garbled) == Code.UNAUTHORIZED
        # bob's key names alice's namespace
        foreign = signed(ak="AK-bob", sk="SK-bob", namespace="ns-a")
        assert route(stub, "t", foreign) == Code.FORBIDDEN


def test_signature_date_checked_against_the_clock(secured: LiveServer) -> None:
    """A signature covers only its date, so a stale one (a captured header replayed)
    is refused; the window spans every time zone, because rocketmq-python-client
    stamps its local time with a "Z"."""
    now = time.time()

    def at(offset_s: float) -> list[tuple[str, str]]:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now + offset_s))
        return signed(ak="AK-alice", sk="SK-alice", date_time=stamp)

    hour = 3600
    with raw_stub(secured) as stub:
        assert route(stub, "t", at(13 * hour)) == Code.OK  # a client at UTC+13
        assert route(stub, "t", at(-11 * hour)) == Code.OK  # a client at UTC-11
        assert route(stub, "t", at(-2 * 24 * hour)) == Code.UNAUTHORIZED  # replayed
        assert route(stub, "t", at(2 * 24 * hour)) == Code.UNAUTHORIZED
        malformed = signed(ak="AK-alice", sk="SK-alice", date_time="2025-01-01 00:00")
        assert route(stub, "t", malformed) == Code.UNAUTHORIZED


def test_namespace_selects_tenant(secured: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    alice = {"ak": "AK-alice", "sk": "SK-alice", "namespace": "ns-a"}
    with (
        producer(secured, topic, **alice) as p,
        simple_consumer(secured, group, topic, **alice) as c,
    ):
        p.send(message(topic, b"for alice"))
        [got] = receive_all(c, 1)
        c.ack(got)
    assert got.body == b"for alice"
    assert got.namespace == "ns-a"
    admin = Caller(principal=ANONYMOUS, namespace="ns-a", protocol="test")
    info = secured.call(lambda: secured.gateway.processor.describe_topic(admin, topic))
    assert info.namespace == "ns-a"
    # the default namespace of alice's account is used when the client names none
    bob = {"ak": "AK-bob", "sk": "SK-bob"}
    with producer(secured, topic, **bob) as p:
        p.send(message(topic, b"for bob"))
    admin_b = Caller(principal=ANONYMOUS, namespace="ns-b", protocol="test")
    info = secured.call(lambda: secured.gateway.processor.describe_topic(admin_b, topic))
    assert info.namespace == "ns-b"


def test_wrong_secret_fails_client(secured: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    topic = unique("t")
    wrong = {"ak": "AK-alice", "sk": "nope", "namespace": "ns-a"}
    with producer(secured, topic, **wrong) as p, pytest.raises(Exception, match="route"):
        p.send(message(topic, b"x"))
    # the client logs the status it got for the route query
    assert f"{Code.UNAUTHORIZED}, signature does not match" in caplog.text
