"""QueryRoute and QueryAssignment: where a topic's queues are served.

The answer names this gateway (the endpoints the client reached it through, as
Apache's proxy does in its local mode), never a storage node. A topic that does not
exist yet is routed as accepting every message type when auto-create is on; the
first message sent creates it with that message's type.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from rocketmq.grpc_protocol import definition_pb2, service_pb2

from protocols.rocketmq import mapping
from protocols.rocketmq.runtime import Runtime
from protocols.rocketmq.status import Code, RpcFailure, ok

__all__ = ["BROKER_NAME", "query_assignment", "query_route"]

BROKER_NAME = "polymq"


def _scheme(host: str) -> int:
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return int(definition_pb2.DOMAIN_NAME)
    return int(definition_pb2.IPv4 if version == 4 else definition_pb2.IPv6)


def _endpoints(rt: Runtime, requested: Any) -> Any:
    if requested is not None and len(requested.addresses):
        return requested
    host, port = rt.address
    endpoints = definition_pb2.Endpoints(scheme=_scheme(host))
    endpoints.addresses.add(host=host, port=port)
    return endpoints


def _queue(topic: Any, queue_id: int, endpoints: Any, types: list[int]) -> Any:
    queue = definition_pb2.MessageQueue(
        id=queue_id, permission=definition_pb2.READ_WRITE, accept_message_types=types
    )
    queue.topic.CopyFrom(topic)
    queue.broker.name = BROKER_NAME
    queue.broker.id = 0
    queue.broker.endpoints.CopyFrom(endpoints)
    return queue


async def query_route(rt: Runtime, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.topic.resource_namespace)
    info = await rt.find_topic(caller, request.topic.name)
    if info is None and not rt.auto_create:
        raise RpcFailure(Code.TOPIC_NOT_FOUND, f"topic {request.topic.name!r} does not exist")
    count = info.config.queue_count if info is not None else rt.options.default_queue_count
    types = mapping.accepted_types(info.config.message_type if info is not None else None)
    endpoints = _endpoints(rt, request.endpoints)
    return service_pb2.QueryRouteResponse(
        status=ok(),
        message_queues=[_queue(request.topic, q, endpoints, types) for q in range(count)],
    )


async def query_assignment(rt: Runtime, request: Any, context: Any) -> Any:
    """One assignment of queue ``-1`` (every queue of the topic): push consumers then
    pop across the whole topic, and the server balances messages among them, as
    Apache's proxy assigns pop consumers."""
    caller = rt.caller(context, request.topic.resource_namespace)
    info = await rt.find_topic(caller, request.topic.name)
    if info is None and not rt.auto_create:
        raise RpcFailure(Code.TOPIC_NOT_FOUND, f"topic {request.topic.name!r} does not exist")
    types = mapping.accepted_types(info.config.message_type if info is not None else None)
    endpoints = _endpoints(rt, request.endpoints)
    assignment = definition_pb2.Assignment()
    assignment.message_queue.CopyFrom(_queue(request.topic, -1, endpoints, types))
    return service_pb2.QueryAssignmentResponse(status=ok(), assignments=[assignment])
