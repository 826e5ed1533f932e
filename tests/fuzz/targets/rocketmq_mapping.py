"""RocketMQ 5 gRPC request messages parsed from bytes (as the service's deserializer
does), then mapped to the model: a send's messages through ``message_type_of`` and
``from_proto``, the filters of a receive, a pull and a telemetry subscription through
``parse_filter`` (so SQL92 too) and matched against each sent message.

The first byte picks the request type; the rest is the protobuf message.
Documented errors: protobuf's ``DecodeError`` (answered with a BAD_REQUEST status) and
:class:`RpcFailure` (its status code).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError
from rocketmq.grpc_protocol import service_pb2

from polymq.protocols.rocketmq.filters import MATCH_ALL, Filter, parse_filter
from polymq.protocols.rocketmq.mapping import from_proto, message_type_of
from polymq.protocols.rocketmq.status import RpcFailure
from polymq.storage.model import Message

_NOW_MS = 1_700_000_000_000

REQUESTS: tuple[Any, ...] = (
    service_pb2.SendMessageRequest,
    service_pb2.ReceiveMessageRequest,
    service_pb2.PullMessageRequest,
    service_pb2.TelemetryCommand,
)


def _filters(request: Any) -> list[Filter]:
    if isinstance(request, service_pb2.TelemetryCommand):
        entries = request.settings.subscription.subscriptions
        return [parse_filter(e.expression.type, e.expression.expression) for e in entries]
    if isinstance(request, service_pb2.SendMessageRequest):
        return []
    expression = request.filter_expression
    return [parse_filter(expression.type, expression.expression)]


def _messages(request: Any) -> list[Message]:
    if not isinstance(request, service_pb2.SendMessageRequest):
        return []
    mapped = []
    for pb in request.messages:
        try:
            message_type_of(pb)
            mapped.append(
                from_proto(pb, max_body_bytes=4 << 20, now_ms=_NOW_MS, max_delay_ms=86400000)
            )
        except RpcFailure:
            pass
    return mapped


def one_input(data: bytes) -> None:
    if not data:
        return
    try:
        request = REQUESTS[data[0] % len(REQUESTS)].FromString(data[1:])
    except DecodeError:
        return
    messages = _messages(request) or [Message(body=b"x", tag="a", properties=(("k", b"1"),))]
    try:
        filters = _filters(request)
    except RpcFailure:
        return
    for selector in filters or [MATCH_ALL]:
        for message in messages:
            selector.matches(message)
