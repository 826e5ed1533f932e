"""``apache.rocketmq.v2.MessagingService``: each RPC routed to its activity, and every
failure answered with a ``Status`` in the RPC's own response type (never an unhandled
exception, which a client would only see as a bare gRPC UNKNOWN).

The method handlers are built here rather than by the generated
``add_MessagingServiceServicer_to_server`` so that a request whose protobuf does not
parse reaches the handler as :class:`Malformed` and is answered BAD_REQUEST, instead
of failing inside grpc before any of our code runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from google.protobuf.message import DecodeError
from rocketmq.grpc_protocol import Code, service_pb2

from polymq.protocols.grpc_server.calls import Method
from polymq.protocols.rocketmq.activities import (
    ack,
    offsets,
    receive,
    route,
    send,
    telemetry,
    transaction,
)
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.status import Malformed, RpcFailure, log_refusal, status_for

__all__ = ["SERVICE_NAME", "method_table"]

SERVICE_NAME = "apache.rocketmq.v2.MessagingService"
_METHODS = service_pb2.DESCRIPTOR.services_by_name["MessagingService"].methods_by_name

Unary = Callable[[RocketMQServices, Any, Any], Awaitable[Any]]
Streaming = Callable[[RocketMQServices, Any, Any], AsyncIterator[Any]]


async def _unsupported(rt: RocketMQServices, request: Any, context: Any) -> Any:
    raise RpcFailure(Code.UNSUPPORTED, "lite topics are not supported")


_UNARY: dict[str, tuple[Unary, Any]] = {
    "QueryRoute": (route.query_route, service_pb2.QueryRouteResponse),
    "QueryAssignment": (route.query_assignment, service_pb2.QueryAssignmentResponse),
    "Heartbeat": (telemetry.heartbeat, service_pb2.HeartbeatResponse),
    "NotifyClientTermination": (
        telemetry.notify_client_termination,
        service_pb2.NotifyClientTerminationResponse,
    ),
    "SendMessage": (send.send_message, service_pb2.SendMessageResponse),
    "RecallMessage": (send.recall_message, service_pb2.RecallMessageResponse),
    "EndTransaction": (transaction.end_transaction, service_pb2.EndTransactionResponse),
    "AckMessage": (ack.ack_message, service_pb2.AckMessageResponse),
    "ChangeInvisibleDuration": (
        ack.change_invisible_duration,
        service_pb2.ChangeInvisibleDurationResponse,
    ),
    "ForwardMessageToDeadLetterQueue": (
        ack.forward_to_dead_letter_queue,
        service_pb2.ForwardMessageToDeadLetterQueueResponse,
    ),
    "UpdateOffset": (offsets.update_offset, service_pb2.UpdateOffsetResponse),
    "GetOffset": (offsets.get_offset, service_pb2.GetOffsetResponse),
    "QueryOffset": (offsets.query_offset, service_pb2.QueryOffsetResponse),
    "SyncLiteSubscription": (_unsupported, service_pb2.SyncLiteSubscriptionResponse),
}

_STREAMING: dict[str, tuple[Streaming, Any]] = {
    "ReceiveMessage": (receive.receive_message, service_pb2.ReceiveMessageResponse),
    "PullMessage": (offsets.pull_message, service_pb2.PullMessageResponse),
    "Telemetry": (telemetry.telemetry, service_pb2.TelemetryCommand),
}


def _deserializer(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return Malformed(str(e))

    return parse


def _refused(name: str, context: Any, answer: Any) -> Any:
    log_refusal(name, context.peer(), answer)
    return answer


def _unary(
    rt: RocketMQServices, name: str, activity: Unary, response: Any
) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handle(request: Any, context: Any) -> Any:
        if isinstance(request, Malformed):
            return response(status=_refused(name, context, request.status()))
        try:
            return await activity(rt, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return response(status=_refused(name, context, status_for(e)))

    return handle


def _streaming(
    rt: RocketMQServices, name: str, activity: Streaming, response: Any
) -> Callable[[Any, Any], AsyncIterator[Any]]:
    async def handle(request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            yield response(status=_refused(name, context, request.status()))
            return
        try:
            async for item in activity(rt, request, context):
                yield item
        except asyncio.CancelledError:
            raise
        except Exception as e:
            yield response(status=_refused(name, context, status_for(e)))

    return handle


def method_table(rt: RocketMQServices) -> dict[str, Method]:
    """Every RPC of the service, keyed by its gRPC path."""
    table: dict[str, Method] = {}
    for name, method in _METHODS.items():
        parse = _deserializer(getattr(service_pb2, method.input_type.name))
        path = f"/{SERVICE_NAME}/{name}"
        if name in _UNARY:
            activity, response = _UNARY[name]
            table[path] = Method(
                _unary(rt, name, activity, response), parse, response.SerializeToString
            )
        else:
            streaming, response = _STREAMING[name]
            table[path] = Method(
                _streaming(rt, name, streaming, response),
                parse,
                response.SerializeToString,
                client_streaming=method.client_streaming,
                server_streaming=True,
            )
    return table
