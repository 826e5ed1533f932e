"""QueryRoute and QueryAssignment: where a topic's queues are served.

The answer names gateways, never storage nodes: the live ones from the gateway
directory (``directory.endpoints("rocketmq")``, or ``"rocketmq_tls"`` for a client of
the TLS listener). Each queue is routed to one of them
by rendezvous hashing of ``<topic>/<queue>`` (every gateway computes the same routes),
so clients spread their load; any gateway serves any queue, since storage is shared.
A gateway listed without a host (the merged form: this one) is named by the endpoints
the client reached it through, as Apache's proxy does in its local mode. A topic that
does not exist yet is routed as accepting every message type when auto-create is on;
the first message sent creates it with that message's type.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from rocketmq.grpc_protocol import definition_pb2, service_pb2

from polymq.navigation.endpoints import GatewayEndpoint, owner_of
from polymq.protocols.rocketmq import mapping
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.status import Code, RpcFailure, ok

__all__ = ["BROKER_NAME", "query_assignment", "query_route"]

BROKER_NAME = "polymq"
PROTOCOL = "rocketmq"


def _scheme(host: str) -> int:
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return int(definition_pb2.DOMAIN_NAME)
    return int(definition_pb2.IPv4 if version == 4 else definition_pb2.IPv6)


# The endpoints a client says it reached us through are echoed in every queue of the
# route: a few addresses of a few bytes each, never a peer-sized amplification.
MAX_REQUESTED_ADDRESSES = 16
MAX_REQUESTED_ENDPOINTS_BYTES = 4096


class _Gateways:
    """The live gateways as route entries for one request."""

    def __init__(self, rt: RocketMQServices, requested: Any) -> None:
        if requested is not None and (
            len(requested.addresses) > MAX_REQUESTED_ADDRESSES
            or requested.ByteSize() > MAX_REQUESTED_ENDPOINTS_BYTES
        ):
            raise RpcFailure(
                Code.ILLEGAL_ACCESS_POINT,
                f"endpoints name more than {MAX_REQUESTED_ADDRESSES} addresses "
                f"or {MAX_REQUESTED_ENDPOINTS_BYTES} bytes",
            )
        self._rt = rt
        self._requested = requested
        listed = rt.directory.endpoints(rt.listener) if rt.directory is not None else ()
        self._listed: list[GatewayEndpoint] = list(listed)

    def owner(self, key: str) -> GatewayEndpoint | None:
        return owner_of(key, self._listed)

    def broker(self, key: str) -> tuple[str, Any]:
        """The broker name and endpoints routing ``key``. One gateway keeps the
        name the single-gateway form always had."""
        owner = self.owner(key)
        name = BROKER_NAME if len(self._listed) <= 1 or owner is None else owner.gateway_id
        if owner is None or not owner.host:
            return name, self._own_endpoints(owner.port if owner is not None else None)
        endpoints = definition_pb2.Endpoints(scheme=_scheme(owner.host))
        endpoints.addresses.add(host=owner.host, port=owner.port)
        return name, endpoints

    def _own_endpoints(self, port: int | None) -> Any:
        requested = self._requested
        if requested is not None and len(requested.addresses):
            if port is None or any(a.port == port for a in requested.addresses):
                return requested
            host = requested.addresses[0].host  # the host the client reached us on
        else:
            host, bound = self._rt.address
            port = bound if port is None else port
        endpoints = definition_pb2.Endpoints(scheme=_scheme(host))
        endpoints.addresses.add(host=host, port=port)
        return endpoints


def _queue(topic: Any, queue_id: int, broker: tuple[str, Any], types: list[int]) -> Any:
    queue = definition_pb2.MessageQueue(
        id=queue_id, permission=definition_pb2.READ_WRITE, accept_message_types=types
    )
    queue.topic.CopyFrom(topic)
    queue.broker.name, endpoints = broker
    queue.broker.id = 0
    queue.broker.endpoints.CopyFrom(endpoints)
    return queue


async def query_route(rt: RocketMQServices, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.topic.resource_namespace)
    await rt.processor.authorize(caller, "topic", request.topic.name, "describe")
    info = await rt.find_topic(caller, request.topic.name)
    if info is None and not rt.auto_create:
        raise RpcFailure(Code.TOPIC_NOT_FOUND, f"topic {request.topic.name!r} does not exist")
    count = info.config.queue_count if info is not None else rt.options.default_queue_count
    types = mapping.accepted_types(info.config.message_type if info is not None else None)
    gateways = _Gateways(rt, request.endpoints)
    name = request.topic.name
    return service_pb2.QueryRouteResponse(
        status=ok(),
        message_queues=[
            _queue(request.topic, q, gateways.broker(f"{name}/{q}"), types) for q in range(count)
        ],
    )


async def query_assignment(rt: RocketMQServices, request: Any, context: Any) -> Any:
    """One assignment of queue ``-1`` (every queue of the topic): push consumers then
    pop across the whole topic, and the server balances messages among them, as
    Apache's proxy assigns pop consumers. The group's consumers of a topic all go to
    one gateway (any would do; one keeps their long polls together)."""
    caller = rt.caller(context, request.topic.resource_namespace)
    await rt.processor.authorize(caller, "topic", request.topic.name, "describe")
    info = await rt.find_topic(caller, request.topic.name)
    if info is None and not rt.auto_create:
        raise RpcFailure(Code.TOPIC_NOT_FOUND, f"topic {request.topic.name!r} does not exist")
    types = mapping.accepted_types(info.config.message_type if info is not None else None)
    broker = _Gateways(rt, request.endpoints).broker(f"{request.group.name}/{request.topic.name}")
    assignment = definition_pb2.Assignment()
    assignment.message_queue.CopyFrom(_queue(request.topic, -1, broker, types))
    return service_pb2.QueryAssignmentResponse(status=ok(), assignments=[assignment])
