"""Offset-mode consumption: PullMessage, UpdateOffset, GetOffset, QueryOffset.

These address one message queue by id and move through its offsets, as a Kafka
consumer does; committed offsets are the group's cursor in storage, shared with other
offset-mode protocols.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.gateway.permissions import Operation
from polymq.gateway.processor import Caller
from polymq.protocols.rocketmq import mapping
from polymq.protocols.rocketmq.activities.receive import duration_ms
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.status import RpcFailure, ok, status
from polymq.storage.model import QueueRef, TopicInfo

__all__ = ["get_offset", "pull_message", "query_offset", "update_offset"]


async def _queue(
    rt: RocketMQServices, caller: Caller, message_queue: Any, operation: Operation
) -> tuple[TopicInfo, QueueRef]:
    await rt.processor.authorize(caller, "topic", message_queue.topic.name, operation)
    info = await rt.topic(caller, message_queue.topic.name, create_as=None)
    if not 0 <= message_queue.id < info.config.queue_count:
        raise RpcFailure(Code.BAD_REQUEST, f"topic {info.name!r} has no queue {message_queue.id}")
    return info, QueueRef(info.namespace, info.name, message_queue.id)


async def pull_message(rt: RocketMQServices, request: Any, context: Any) -> AsyncIterator[Any]:
    caller = rt.caller(context, request.group.resource_namespace)
    await rt.check_group(caller, request.group.name)
    info, queue = await _queue(rt, caller, request.message_queue, "read")
    selector = rt.filter(request.filter_expression.type, request.filter_expression.expression)
    wait = min(duration_ms(request.long_polling_timeout), rt.options.max_long_polling_ms)
    remaining = context.time_remaining()
    if remaining is not None:
        wait = max(0, min(wait, int(remaining * 1000) - 500))
    result = await rt.processor.read(
        caller,
        queue,
        request.offset,
        max_messages=min(max(request.batch_size, 1), rt.options.max_batch_size),
        wait_ms=wait,
    )
    messages = [m for m in result.messages if selector.matches(m.message)]
    if messages:
        yield service_pb2.PullMessageResponse(status=ok())
        for stored in messages:
            yield service_pb2.PullMessageResponse(
                message=mapping.to_proto(
                    stored,
                    namespace=request.group.resource_namespace,
                    message_type=info.config.message_type,
                    store_host=rt.store_host,
                )
            )
    else:
        yield service_pb2.PullMessageResponse(
            status=status(Code.MESSAGE_NOT_FOUND, "no new message")
        )
    yield service_pb2.PullMessageResponse(next_offset=result.next_offset)


async def update_offset(rt: RocketMQServices, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.group.resource_namespace)
    await rt.check_group(caller, request.group.name)
    _, queue = await _queue(rt, caller, request.message_queue, "read")
    if request.offset < 0:
        raise RpcFailure(Code.ILLEGAL_OFFSET, "offset must not be negative")
    await rt.processor.commit_offset(caller, request.group.name, queue, request.offset)
    return service_pb2.UpdateOffsetResponse(status=ok())


async def get_offset(rt: RocketMQServices, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.group.resource_namespace)
    await rt.check_group(caller, request.group.name)
    _, queue = await _queue(rt, caller, request.message_queue, "describe")
    committed = await rt.processor.fetch_offset(caller, request.group.name, queue)
    if committed is None:
        raise RpcFailure(Code.OFFSET_NOT_FOUND, "the group has committed no offset here")
    return service_pb2.GetOffsetResponse(status=ok(), offset=committed.offset)


async def query_offset(rt: RocketMQServices, request: Any, context: Any) -> Any:
    caller = rt.caller(context, request.message_queue.topic.resource_namespace)
    _, queue = await _queue(rt, caller, request.message_queue, "describe")
    policy = request.query_offset_policy
    if policy == definition_pb2.TIMESTAMP:
        if not request.HasField("timestamp"):
            raise RpcFailure(Code.BAD_REQUEST, "TIMESTAMP policy needs a timestamp")
        try:
            timestamp_ms = request.timestamp.ToMilliseconds()
        except ValueError as e:  # outside years 1..9999
            raise RpcFailure(Code.BAD_REQUEST, f"timestamp is out of range: {e}") from e
        offset = await rt.processor.offset_for_timestamp(caller, queue, timestamp_ms)
    else:
        bounds = await rt.processor.queue_offsets(caller, queue)
        offset = bounds.earliest if policy == definition_pb2.BEGINNING else bounds.latest
    return service_pb2.QueryOffsetResponse(status=ok(), offset=offset)
