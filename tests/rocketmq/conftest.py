"""A live gateway serving RocketMQ, and helpers to drive rocketmq-python-client."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)
from rocketmq.grpc_protocol import MessagingServiceStub, definition_pb2

from polymq.gateway.accounts import ANONYMOUS
from polymq.gateway.listeners import Listener, ListenerContext
from polymq.gateway.processor import Caller
from polymq.protocols.rocketmq import RocketMQOptions, auth, rocketmq_listener
from polymq.storage.model import DEFAULT_NAMESPACE, GroupConfig, TopicConfig
from tests.live_server import LiveServer, live_server

_T = TypeVar("_T")

# Shorter than Apache's defaults so tests need not sleep through them.
TEST_OPTIONS = RocketMQOptions(
    min_invisible_ms=1_000,
    transaction_check_interval_ms=300,
    transaction_timeout_ms=300,
    transaction_max_checks=3,
    retry_backoff_s=(1,),
    long_polling_ms=2_000,  # push consumers' long poll: the node client waits it out on shutdown
)


def factory(options: RocketMQOptions = TEST_OPTIONS) -> Callable[[ListenerContext], Listener]:
    return lambda context: rocketmq_listener(context, options)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    with live_server(tmp_path, ("rocketmq",), factories={"rocketmq": factory()}) as live:
        yield live


def endpoint(server: LiveServer) -> str:
    return f"127.0.0.1:{server.port('rocketmq')}"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_until(check: Callable[[], _T | None], timeout: float = 30.0, every: float = 0.05) -> _T:
    """Poll ``check`` until it returns something truthy (the condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(every)


def receive_all(
    consumer: Any, count: int, *, invisible_s: int = 15, timeout: float = 30.0
) -> list[Any]:
    """Receive until ``count`` messages arrived, acking none."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"received {len(got)} of {count} messages")
        got.extend(consumer.receive(32, invisible_s))
    return got


ADMIN = Caller(principal=ANONYMOUS, namespace=DEFAULT_NAMESPACE, protocol="test")


def client_config(server: LiveServer, *, ak: str = "", sk: str = "", namespace: str = "") -> Any:
    return ClientConfiguration(endpoint(server), Credentials(ak, sk), namespace)


@contextmanager
def started(client: Any) -> Iterator[Any]:
    client.startup()
    try:
        yield client
    finally:
        client.shutdown()


def producer(server: LiveServer, *topics: str, checker: Any = None, **kw: Any) -> Any:
    return started(Producer(client_config(server, **kw), topics, checker))


def simple_consumer(
    server: LiveServer, group: str, topic: str, expression: Any = None, **kw: Any
) -> Any:
    subscription = {topic: expression or FilterExpression()}
    return started(
        SimpleConsumer(client_config(server, **kw), group, subscription, await_duration=3)
    )


def message(topic: str, body: bytes = b"body", **fields: Any) -> Any:
    msg = Message()
    msg.topic = topic
    msg.body = body
    for name, value in fields.items():
        if name == "properties":
            for key, prop in value.items():
                msg.add_property(key, prop)
        else:
            setattr(msg, name, value)
    return msg


def set_group(server: LiveServer, group: str, config: GroupConfig) -> None:
    server.call(lambda: server.gateway.processor.set_group_config(ADMIN, group, config))


def create_topic(server: LiveServer, topic: str, config: TopicConfig) -> None:
    server.call(lambda: server.gateway.processor.create_topic(ADMIN, topic, config))


@contextmanager
def raw_stub(server: LiveServer) -> Iterator[Any]:
    """A bare gRPC stub, for requests the official client would refuse to send."""
    with grpc.insecure_channel(endpoint(server)) as channel:
        yield MessagingServiceStub(channel)


def signed(
    *,
    ak: str = "",
    sk: str = "",
    namespace: str = "",
    client_id: str = "raw-client",
    date_time: str | None = None,
) -> list[tuple[str, str]]:
    """Request metadata as the official clients send it (signed now, in UTC, unless
    ``date_time`` says otherwise)."""
    date_time = date_time or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    authorization = (
        f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, "
        f"Signature={auth.sign(sk, date_time)}"
    )
    return [
        ("x-mq-date-time", date_time),
        ("x-mq-client-id", client_id),
        ("x-mq-namespace", namespace),
        ("authorization", authorization),
    ]


def raw_message(topic: str, body: bytes = b"raw", **system: Any) -> Any:
    msg = definition_pb2.Message(body=body)
    msg.topic.name = topic
    msg.system_properties.message_id = uuid.uuid4().hex
    for name, value in system.items():
        setattr(msg.system_properties, name, value)
    return msg
