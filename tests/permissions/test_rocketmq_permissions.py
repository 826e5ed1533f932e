"""RocketMQ 5: the permission model's refusals are FORBIDDEN, seen by
rocketmq-python-client (send, receive) and a signed raw stub (the exact code); another
namespace is FORBIDDEN even for QueryRoute."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from tests.live_server import LiveServer
from tests.permissions.accounts import OTHER, SHOP, permission_server
from tests.rocketmq.conftest import (
    message,
    producer,
    raw_message,
    raw_stub,
    receive_all,
    signed,
    simple_consumer,
    unique,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_form: str) -> Iterator[LiveServer]:
    with permission_server(tmp_path_factory.mktemp("perm-rocketmq"), ("rocketmq",)) as s:
        yield s


def _keys(user: str, namespace: str = SHOP) -> dict[str, str]:
    return {"ak": f"{user}-ak", "sk": f"{user}-sk", "namespace": namespace}


def _send_code(server: LiveServer, user: str, topic: str, namespace: str = SHOP) -> int:
    with raw_stub(server) as stub:
        request = service_pb2.SendMessageRequest(messages=[raw_message(topic)])
        request.messages[0].topic.resource_namespace = namespace
        answer = stub.SendMessage(request, metadata=signed(**_keys(user, namespace)))
    return int(answer.status.code)


def _route_code(server: LiveServer, user: str, topic: str, namespace: str = SHOP) -> int:
    with raw_stub(server) as stub:
        request = service_pb2.QueryRouteRequest(
            topic=definition_pb2.Resource(name=topic, resource_namespace=namespace)
        )
        answer = stub.QueryRoute(request, metadata=signed(**_keys(user, namespace)))
    return int(answer.status.code)


def test_writer_sends_reader_receives_and_not_the_reverse(server: LiveServer) -> None:
    topic, group = unique("data-"), unique("g")
    with producer(server, topic, **_keys("writer")) as p:
        p.send(message(topic, b"allowed"))
    with simple_consumer(server, group, topic, **_keys("reader")) as c:
        [got] = receive_all(c, 1)
        c.ack(got)
    assert got.body == b"allowed"
    assert _send_code(server, "reader", topic) == Code.FORBIDDEN
    assert _send_code(server, "writer", topic) == Code.OK
    with (
        producer(server, topic, **_keys("reader")) as p,
        pytest.raises(Exception, match=str(Code.FORBIDDEN)),
    ):
        p.send(message(topic, b"refused"))
    with (
        pytest.raises(Exception, match=str(Code.FORBIDDEN)),
        simple_consumer(server, group, topic, **_keys("writer")) as c,
    ):
        c.receive(1, 10)


def test_a_topic_outside_the_rules(server: LiveServer) -> None:
    topic = unique("secret-")
    assert _send_code(server, "guest", topic) == Code.OK  # no rules: the whole namespace
    assert _route_code(server, "reader", topic) == Code.FORBIDDEN
    assert _route_code(server, "guest", topic) == Code.OK


def test_another_namespace_is_forbidden(server: LiveServer) -> None:
    topic = unique("data-")
    assert _send_code(server, "writer", topic) == Code.OK
    assert _route_code(server, "outsider", topic, SHOP) == Code.FORBIDDEN
    assert _send_code(server, "outsider", topic, SHOP) == Code.FORBIDDEN
    assert _route_code(server, "outsider", topic, OTHER) in (Code.OK, Code.TOPIC_NOT_FOUND)
