"""Bad input gets RocketMQ's status codes; the server and other clients carry on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2
from rocketmq.v5.exception import IllegalArgumentException

from polymq.storage.model import MessageType, TopicConfig
from tests.live_server import LiveServer, live_server
from tests.rocketmq.conftest import (
    create_topic,
    factory,
    message,
    producer,
    raw_message,
    raw_stub,
    receive_all,
    signed,
    simple_consumer,
    unique,
)


def send(stub: Any, *messages: Any) -> Any:
    request = service_pb2.SendMessageRequest(messages=list(messages))
    return stub.SendMessage(request, metadata=signed())


def test_malformed_protobuf_fails_only_that_call(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with grpc.insecure_channel(f"127.0.0.1:{server.port('rocketmq')}") as channel:
        garbage = channel.unary_unary(
            "/apache.rocketmq.v2.MessagingService/SendMessage",
            response_deserializer=service_pb2.SendMessageResponse.FromString,
        )
        answer = garbage(b"\xff\xff\xff\xff\x0f", metadata=signed())
        assert answer.status.code == Code.BAD_REQUEST
        receive = channel.unary_stream(
            "/apache.rocketmq.v2.MessagingService/ReceiveMessage",
            response_deserializer=service_pb2.ReceiveMessageResponse.FromString,
        )
        [answer] = receive(b"\x0a\xff", metadata=signed(), timeout=10)
        assert answer.status.code == Code.BAD_REQUEST
        telemetry = channel.stream_stream(
            "/apache.rocketmq.v2.MessagingService/Telemetry",
            response_deserializer=service_pb2.TelemetryCommand.FromString,
        )
        stream = telemetry(iter([b"\x12\xff\xff"]), metadata=signed(), timeout=10)
        first = next(stream)
        assert first.status.code == Code.BAD_REQUEST  # answered on the stream
        stream.cancel()
        unknown = channel.unary_unary("/apache.rocketmq.v2.MessagingService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as e:
            unknown(b"", metadata=signed())
        assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
    with producer(server, topic) as p, simple_consumer(server, group, topic) as c:
        p.send(message(topic, b"still fine"))
        [got] = receive_all(c, 1)
        c.ack(got)
    assert got.body == b"still fine"


def test_message_checks(server: LiveServer) -> None:
    topic = unique("t")
    with raw_stub(server) as stub:
        assert send(stub).status.code == Code.BAD_REQUEST
        assert send(stub, raw_message(topic, b"")).status.code == Code.MESSAGE_BODY_EMPTY
        big = raw_message(topic, b"x" * ((4 << 20) + 1))
        assert send(stub, big).status.code == Code.MESSAGE_BODY_TOO_LARGE
        long_group = raw_message(topic, message_group="g" * 65)
        assert send(stub, long_group).status.code == Code.ILLEGAL_MESSAGE_GROUP
        bad_tag = raw_message(topic, tag="a||b")
        assert send(stub, bad_tag).status.code == Code.ILLEGAL_MESSAGE_TAG
        blank_key = raw_message(topic)
        blank_key.system_properties.keys.append(" ")
        assert send(stub, blank_key).status.code == Code.ILLEGAL_MESSAGE_KEY
        too_late = raw_message(topic)
        too_late.system_properties.delivery_timestamp.seconds = int(time.time()) + 4 * 86400
        assert send(stub, too_late).status.code == Code.ILLEGAL_DELIVERY_TIME
        ok = send(stub, raw_message(topic, b"fine"))
        assert ok.status.code == Code.OK
        assert ok.entries[0].message_id


def test_wrong_message_type_for_topic(server: LiveServer) -> None:
    topic = unique("t")
    create_topic(server, topic, TopicConfig(queue_count=2, message_type=MessageType.FIFO))
    with raw_stub(server) as stub:
        normal = raw_message(topic, message_type=definition_pb2.NORMAL)
        answer = send(stub, normal)
        assert answer.status.code == Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE
        route = stub.QueryRoute(
            service_pb2.QueryRouteRequest(topic=definition_pb2.Resource(name=topic)),
            metadata=signed(),
        )
        assert route.status.code == Code.OK
        assert len(route.message_queues) == 2
        assert list(route.message_queues[0].accept_message_types) == [definition_pb2.FIFO]
        # no endpoints in the request: the route names the listener's own address
        broker = route.message_queues[0].broker.endpoints
        assert broker.scheme == definition_pb2.IPv4
        assert (broker.addresses[0].host, broker.addresses[0].port) == server.address("rocketmq")
    with producer(server, topic) as p, pytest.raises(IllegalArgumentException):
        p.send(message(topic, b"normal"))  # the client checks the route's types too


def test_receipt_and_receive_checks(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    resource = definition_pb2.Resource
    with raw_stub(server) as stub:
        assert send(stub, raw_message(topic)).status.code == Code.OK
        ack = stub.AckMessage(
            service_pb2.AckMessageRequest(
                group=resource(name=group),
                topic=resource(name=topic),
                entries=[service_pb2.AckMessageEntry(message_id="x", receipt_handle="bogus")],
            ),
            metadata=signed(),
        )
        assert ack.status.code == Code.INVALID_RECEIPT_HANDLE
        change = stub.ChangeInvisibleDuration(
            service_pb2.ChangeInvisibleDurationRequest(
                group=resource(name=group), topic=resource(name=topic), receipt_handle="AAAA"
            ),
            metadata=signed(),
        )
        assert change.status.code == Code.INVALID_RECEIPT_HANDLE

        def receive(**fields: Any) -> list[Any]:
            request = service_pb2.ReceiveMessageRequest(
                group=resource(name=group), batch_size=1, **fields
            )
            request.message_queue.topic.name = topic
            request.long_polling_timeout.seconds = 1
            return list(stub.ReceiveMessage(request, metadata=signed(), timeout=10))

        [answer] = receive(invisible_duration={"nanos": 1000})
        assert answer.status.code == Code.ILLEGAL_INVISIBLE_TIME
        [answer] = receive(
            filter_expression=definition_pb2.FilterExpression(
                type=definition_pb2.SQL, expression="a >"
            )
        )
        assert answer.status.code == Code.ILLEGAL_FILTER_EXPRESSION
        end = stub.EndTransaction(
            service_pb2.EndTransactionRequest(
                topic=resource(name=topic),
                transaction_id="nope",
                resolution=definition_pb2.COMMIT,
            ),
            metadata=signed(),
        )
        assert end.status.code == Code.INVALID_TRANSACTION_ID


@pytest.fixture
def strict_server(tmp_path: Path) -> Iterator[LiveServer]:
    overrides = {"rocketmq.auto_create": "false"}
    with live_server(
        tmp_path, ("rocketmq",), overrides=overrides, factories={"rocketmq": factory()}
    ) as live:
        yield live


def test_unknown_topic_and_group_without_auto_create(strict_server: LiveServer) -> None:
    server = strict_server
    resource = definition_pb2.Resource
    with raw_stub(server) as stub:
        route = stub.QueryRoute(
            service_pb2.QueryRouteRequest(topic=resource(name="missing")), metadata=signed()
        )
        assert route.status.code == Code.TOPIC_NOT_FOUND
        assert send(stub, raw_message("missing")).status.code == Code.TOPIC_NOT_FOUND
        create_topic(server, "present", TopicConfig(queue_count=1))
        assert send(stub, raw_message("present")).status.code == Code.OK
        request = service_pb2.ReceiveMessageRequest(group=resource(name="no-group"), batch_size=1)
        request.message_queue.topic.name = "present"
        [answer] = stub.ReceiveMessage(request, metadata=signed(), timeout=10)
        assert answer.status.code == Code.CONSUMER_GROUP_NOT_FOUND
        heartbeat = stub.Heartbeat(
            service_pb2.HeartbeatRequest(group=resource(name="no-group")), metadata=signed()
        )
        assert heartbeat.status.code == Code.CONSUMER_GROUP_NOT_FOUND
