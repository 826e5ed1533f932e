"""Hostile RocketMQ requests (issue 14): a batch send too large for one request is
refused, an allowed one shares the event loop with every other protocol while it is
stored, and filters nested past the limit are refused before they can recurse."""

from __future__ import annotations

import gzip
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from protocols.mqtt import codec
from protocols.mqtt.listener import mqtt_listener
from protocols.rocketmq.listener import RocketMQListener
from tests.live_server import LiveServer, live_server
from tests.mqtt.helpers import RawClient
from tests.rocketmq.conftest import factory, raw_message, raw_stub, signed, unique

_BATCH_LIMIT = 10_000  # limits.max_batch_items as it ships


class _WatchedProcessor:
    """The listener's processor, counting the messages handed to storage so far: the
    test's view of how far a big send has got, to order another protocol's round trip
    against it."""

    def __init__(self, processor: Any) -> None:
        self._processor = processor
        self.handed = 0
        self.started = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processor, name)

    async def append(self, caller: Any, requests: Any, **kwargs: Any) -> Any:
        self.handed += len(requests)
        self.started.set()
        return await self._processor.append(caller, requests, **kwargs)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    factories = {"rocketmq": factory(), "mqtt": mqtt_listener}
    with live_server(tmp_path, ("rocketmq", "mqtt"), factories=factories) as live:
        yield live


def _runtime(server: LiveServer) -> Any:
    listener = server.gateway.listeners.get("rocketmq")
    assert isinstance(listener, RocketMQListener)
    return listener.runtime


def _batch(topic: str, count: int) -> Any:
    return service_pb2.SendMessageRequest(
        messages=[raw_message(topic, b"m%d" % i) for i in range(count)]
    )


def _receive(stub: Any, topic: str, group: str, expression: str) -> list[Any]:
    request = service_pb2.ReceiveMessageRequest(
        group=definition_pb2.Resource(name=group),
        batch_size=32,
        filter_expression=definition_pb2.FilterExpression(
            type=definition_pb2.SQL, expression=expression
        ),
    )
    request.message_queue.topic.name = topic
    request.long_polling_timeout.seconds = 1
    request.invisible_duration.seconds = 30
    return list(stub.ReceiveMessage(request, metadata=signed(), timeout=30))


def test_batch_over_the_limit_is_refused_whole(server: LiveServer) -> None:
    topic = unique("t")
    with raw_stub(server) as stub:
        answer = stub.SendMessage(_batch(topic, 2 * _BATCH_LIMIT), metadata=signed(), timeout=60)
        assert answer.status.code == Code.PAYLOAD_TOO_LARGE
        assert str(_BATCH_LIMIT) in answer.status.message
        assert not answer.entries
        # nothing of it was stored: the topic was not even created for it
        route = stub.QueryRoute(
            service_pb2.QueryRouteRequest(topic=definition_pb2.Resource(name=topic)),
            metadata=signed(),
        )
        assert route.status.code == Code.OK
        assert list(route.message_queues[0].accept_message_types) == [
            definition_pb2.NORMAL,
            definition_pb2.FIFO,
            definition_pb2.DELAY,
            definition_pb2.TRANSACTION,
        ]
        assert stub.SendMessage(_batch(topic, 1), metadata=signed()).status.code == Code.OK


def test_allowed_batch_shares_the_loop_with_mqtt(server: LiveServer) -> None:
    """A PINGREQ sent once the big send is being stored is answered before the send
    hands its last message to storage: the send gives the loop back as it goes."""
    runtime = _runtime(server)
    watched = _WatchedProcessor(runtime.processor)
    runtime.processor = watched
    mqtt = RawClient(server.port("mqtt"), level=codec.LEVEL_311)
    mqtt.connect("pinger")
    topic = unique("t")
    with raw_stub(server) as stub:
        sending = stub.SendMessage.future(
            _batch(topic, _BATCH_LIMIT), metadata=signed(), timeout=120
        )
        assert watched.started.wait(60), "the send never reached storage"
        mqtt.send(codec.PingReq())
        pong = mqtt.receive()
        handed_at_pong, answered_at_pong = watched.handed, sending.done()
        answer = sending.result()
    mqtt.close()
    assert isinstance(pong, codec.PingResp)
    assert not answered_at_pong
    assert handed_at_pong < _BATCH_LIMIT, "the ping waited for the whole batch"
    assert answer.status.code == Code.OK
    assert len(answer.entries) == _BATCH_LIMIT
    assert len({e.message_id for e in answer.entries}) == _BATCH_LIMIT
    assert watched.handed == _BATCH_LIMIT


def test_deeply_nested_filter_is_refused(server: LiveServer) -> None:
    topic, group = unique("t"), unique("g")
    with raw_stub(server) as stub:
        sent = raw_message(topic, b"kept")
        sent.user_properties["a"] = "1"
        request = service_pb2.SendMessageRequest(messages=[sent])
        assert stub.SendMessage(request, metadata=signed()).status.code == Code.OK
        for hostile in (
            "(" * 50_000 + "a = 1" + ")" * 50_000,  # longer than any filter may be
            "(" * 5_000 + "a = 1" + ")" * 5_000,  # short enough, far too deep
            "NOT " * 3_000 + "a = 1",
        ):
            [answer] = _receive(stub, topic, group, hostile)
            assert answer.status.code == Code.ILLEGAL_FILTER_EXPRESSION
            assert "limit" in answer.status.message or "deeper" in answer.status.message
        # as deep as allowed, and a long OR chain (one node, not a 1,500-deep tree)
        deepest = "(" * 64 + "a = 1" + ")" * 64
        chain = " OR ".join(["a = 2"] * 1_500 + ["a = 1"])
        answers = _receive(stub, topic, group, f"{deepest} AND ({chain})")
    assert answers[0].status.code == Code.OK
    [got] = [a.message for a in answers if a.HasField("message")]
    assert got.body == b"kept"


def _send_one(stub: Any, message: Any) -> Any:
    request = service_pb2.SendMessageRequest(messages=[message])
    return stub.SendMessage(request, metadata=signed(), timeout=30)


def test_bad_values_get_a_status_and_no_traceback(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each value once answered INTERNAL_ERROR (with a traceback), was stored past what
    a consumer can read, or inflated without bound; each now gets a code of its own
    and one log line, and the topic stays whole."""
    caplog.set_level(logging.INFO)
    topic = unique("t")
    resource = definition_pb2.Resource
    with raw_stub(server) as stub:
        assert _send_one(stub, raw_message(topic, b"first")).status.code == Code.OK
        born = raw_message(topic)
        born.system_properties.born_timestamp.seconds = 2**62
        assert _send_one(stub, born).status.code == Code.BAD_REQUEST
        oversized = {
            "tag": raw_message(topic, tag="t" * (8 << 20)),
            "keys": raw_message(topic),
            "property": raw_message(topic),
        }
        oversized["keys"].system_properties.keys.extend(["k"] * 200_000)
        oversized["property"].user_properties["p"] = "v" * (1 << 20)
        for what, message in oversized.items():
            answer = _send_one(stub, message)
            assert answer.status.code == Code.MESSAGE_PROPERTIES_TOO_LARGE, what
        bomb = raw_message(topic, gzip.compress(bytes(64 << 20)))  # 64 KiB inflating to 64 MiB
        bomb.system_properties.body_encoding = definition_pb2.GZIP
        answer = _send_one(stub, bomb)
        assert answer.status.code == Code.MESSAGE_BODY_TOO_LARGE
        assert "inflates" in answer.status.message
        zipped = raw_message(topic, gzip.compress(b"second"))
        zipped.system_properties.body_encoding = definition_pb2.GZIP
        assert _send_one(stub, zipped).status.code == Code.OK

        endpoints = definition_pb2.Endpoints(scheme=definition_pb2.IPv4)
        for i in range(50_000):  # echoed in each of the route's queues
            endpoints.addresses.add(host=f"h{i}", port=i)
        route = stub.QueryRoute(
            service_pb2.QueryRouteRequest(topic=resource(name=topic), endpoints=endpoints),
            metadata=signed(),
        )
        assert route.status.code == Code.ILLEGAL_ACCESS_POINT
        assert not route.message_queues
        query = service_pb2.QueryOffsetRequest(
            message_queue=definition_pb2.MessageQueue(topic=resource(name=topic), id=0),
            query_offset_policy=definition_pb2.TIMESTAMP,
        )
        query.timestamp.seconds = 2**62
        assert stub.QueryOffset(query, metadata=signed()).status.code == Code.BAD_REQUEST
        ack = service_pb2.AckMessageRequest(
            group=resource(name="g"),
            topic=resource(name=topic),
            entries=[
                service_pb2.AckMessageEntry(receipt_handle=f"r{i}") for i in range(_BATCH_LIMIT + 1)
            ],
        )
        assert stub.AckMessage(ack, metadata=signed()).status.code == Code.PAYLOAD_TOO_LARGE
        settings = definition_pb2.Settings(client_type=definition_pb2.PRODUCER)
        settings.publishing.topics.extend(resource(name=f"p{i}") for i in range(_BATCH_LIMIT + 1))
        stream = stub.Telemetry(
            iter([service_pb2.TelemetryCommand(settings=settings)]),
            metadata=signed(client_id=unique("c")),
            timeout=30,
        )
        assert next(stream).status.code == Code.PAYLOAD_TOO_LARGE  # on the stream
        stream.cancel()

        answers = _receive(stub, topic, unique("g"), "TRUE")
    assert {a.message.body for a in answers if a.HasField("message")} == {b"first", b"second"}
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if "index gap" in r.getMessage()]  # storage intact
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 9, [r.getMessage() for r in refusals]
