"""Hostile RocketMQ requests (issue 14): a batch send too large for one request is
refused, an allowed one shares the event loop with every other protocol while it is
stored, filters nested past the limit are refused before they can recurse, a request
grpcio's own server died on is answered and leaves RocketMQ served, a connection that
never finishes its HTTP/2 preface is closed, and metadata that is not UTF-8 is read.
(The HTTP/2 server's own hostile cases are tests/grpc_server's.)"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import logging
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.listener import mqtt_listener
from polymq.protocols.rocketmq.listener import RocketMQListener
from tests.live_server import LiveServer, live_server
from tests.mqtt.helpers import RawClient
from tests.rocketmq.conftest import (
    endpoint,
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


def _services(server: LiveServer) -> Any:
    listener = server.gateway.listeners.get("rocketmq")
    assert isinstance(listener, RocketMQListener)
    return listener.services


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
    services = _services(server)
    watched = _WatchedProcessor(services.processor)
    services.processor = watched
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


# grpcio's aio server decodes the :path with a strict bytes.decode() in its own serving
# loop; this one made that loop raise and the whole grpc server shut down.
_PATH_NOT_UTF8 = b"/apac\xff\xfe.rocketmq.v2.MessagingService/NotifyClientTermination"


# rocketmq-python-client logs its own retries as errors: under load a producer once
# opened its telemetry stream before the client's event-loop thread was up ("There is
# no current event loop"), then retried and started. The client's business, not the
# server's: its records are left out of the server's tracebacks.
_CLIENT_LOGGER = "rocketmq-python-client"


def _tracebacks(records: list[logging.LogRecord]) -> list[str]:
    """The errors and tracebacks the server side logged."""
    return [
        r.getMessage()
        for r in records
        if r.name != _CLIENT_LOGGER
        and (
            r.exc_info or r.exc_text or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()
        )
    ]


def test_a_path_that_is_not_utf8_is_unimplemented_and_rocketmq_served_on(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """(grpcio's server gave up for good on such a ``:path``, decoded strictly before any
    handler of ours ran.) The call is answered UNIMPLEMENTED on its own stream: a
    producer connected before keeps sending over the same connection, a new one
    connects, MQTT lives on, nothing sent is lost, and no traceback is logged."""
    caplog.set_level(logging.INFO)
    topic = unique("t")
    with producer(server, topic) as before:
        before.send(message(topic, b"before"))
        with grpc.insecure_channel(endpoint(server)) as channel:
            hostile = channel.unary_unary(_PATH_NOT_UTF8)
            with pytest.raises(grpc.RpcError) as refused:
                hostile(b"", timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        before.send(message(topic, b"old client"))
        with producer(server, topic) as after:
            after.send(message(topic, b"new client"))
    with simple_consumer(server, unique("g"), topic) as consumer:
        got = receive_all(consumer, 3)
    assert sorted(m.body for m in got) == [b"before", b"new client", b"old client"]
    mqtt = RawClient(server.port("mqtt"), level=codec.LEVEL_311)  # the process lives on
    mqtt.connect("after-grpc")
    mqtt.send(codec.PingReq())
    assert isinstance(mqtt.receive(), codec.PingResp)
    mqtt.close()
    gc.collect()  # a failed task nobody awaited is logged when it is collected
    assert not _tracebacks(caplog.records)


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def test_a_connection_that_never_finishes_its_preface_is_closed(tmp_path: Path) -> None:
    """The HTTP/2 preface and first SETTINGS are due within
    ``limits.handshake_timeout_ms`` (grpcio's own deadline was 120 s)."""
    overrides = {"limits.handshake_timeout_ms": "300"}
    factories = {"rocketmq": factory()}
    with live_server(tmp_path, ("rocketmq",), overrides=overrides, factories=factories) as live:
        with socket.create_connection(("127.0.0.1", live.port("rocketmq")), timeout=30) as sock:
            sock.sendall(_PREFACE[:12])
            try:
                while sock.recv(65536):  # whatever grpc sends first, then the close
                    pass
            except ConnectionResetError:
                pass  # closed as well
            # (a socket.timeout here, after 30 s, means it was kept open)
        with raw_stub(live) as stub:  # and the port still serves
            request = service_pb2.SendMessageRequest(messages=[raw_message(unique("t"))])
            assert stub.SendMessage(request, metadata=signed()).status.code == Code.OK


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, neither part Huffman-coded."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


def _raw_grpc_call(port: int, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
    """One unary gRPC call written by hand (the grpc client refuses to send metadata
    that is not printable ASCII); returns the response message's bytes, or None."""
    block = b"".join(
        _literal(k, v)
        for k, v in [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", b"127.0.0.1"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *headers,
        ]
    )
    message_bytes = b"\x00" + struct.pack(">I", len(body)) + body
    request = (
        _PREFACE
        + _h2_frame(4, 0, 0, b"")  # SETTINGS
        + _h2_frame(1, 0x4, 1, block)  # HEADERS, END_HEADERS
        + _h2_frame(0, 0x1, 1, message_bytes)  # DATA, END_STREAM
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        buffer, data = b"", b""
        while True:
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                size = int.from_bytes(buffer[:3], "big")
                kind, flags = buffer[3], buffer[4]
                stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
                if kind == 4 and not flags & 0x1:
                    sock.sendall(_h2_frame(4, 0x1, 0, b""))  # SETTINGS ACK
                elif kind == 0 and stream == 1:
                    data += payload
                elif (stream == 1 and (kind == 3 or (kind == 1 and flags & 0x1))) or kind == 7:
                    return data[5:] if data else None  # trailers, RST_STREAM or GOAWAY
            chunk = sock.recv(65536)
            if not chunk:
                return data[5:] if data else None
            buffer += chunk


def test_metadata_that_is_not_utf8_is_read_as_latin1(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Such a value is read as Latin-1, as grpc reads it, and the call answered, with
    no traceback (grpcio logged one per value)."""
    caplog.set_level(logging.INFO)
    topic = unique("t")
    metadata = [(k.encode(), v.encode()) for k, v in signed()]
    bad = [(b"x-hostile", b"\xff\xfe value"), (b"x-hostile-2", b"caf\xe9")]
    request = service_pb2.SendMessageRequest(messages=[raw_message(topic, b"latin")])
    answer = _raw_grpc_call(
        server.port("rocketmq"),
        b"/apache.rocketmq.v2.MessagingService/SendMessage",
        metadata + bad,
        request.SerializeToString(),
    )
    assert answer is not None, "no response message"
    assert service_pb2.SendMessageResponse.FromString(answer).status.code == Code.OK
    assert not _tracebacks(caplog.records)


def test_a_taken_port_is_still_an_error(server: LiveServer) -> None:
    """A second listener on a port that one serves already fails to start instead of
    sharing it (SO_REUSEPORT is for polymq run --workers N only)."""
    listener = server.gateway.listeners.get("rocketmq")
    assert isinstance(listener, RocketMQListener)
    second = RocketMQListener(dataclasses.replace(listener._context, port=listener.port))
    with pytest.raises(OSError, match="cannot bind"):
        server.call(second.start)
    with raw_stub(server) as stub:  # the first one serves on
        request = service_pb2.SendMessageRequest(messages=[raw_message(unique("t"))])
        assert stub.SendMessage(request, metadata=signed()).status.code == Code.OK
