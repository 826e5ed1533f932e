"""SendMessage and RecallMessage.

A message's type (NORMAL, FIFO, DELAY, TRANSACTION) must match its topic's, as
Apache's proxy checks it (MESSAGE_PROPERTY_CONFLICT_WITH_TYPE); a topic created on
first use takes the first message's type. The server picks the queue (the v2 request
names none): by the message group's hash for FIFO, so a group stays in one queue and
in order, else in rotation. The client's own message id is the append's dedup key,
so a send the client retries after a lost answer is stored once.
"""

from __future__ import annotations

import zlib
from typing import Any

from rocketmq.grpc_protocol import Code, service_pb2

from polymq.gateway.fairness import cooperatively
from polymq.protocols.rocketmq import mapping, quota
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.slicing import slices_between
from polymq.protocols.rocketmq.status import RpcFailure, ok
from polymq.storage.model import AppendRequest, Message, MessageType, QueueRef, TopicInfo

__all__ = ["recall_message", "send_message"]

# Messages per storage append of a batch send, the loop handed back between appends.
# Each append is one commit (an fsync with sync durability), so this is coarser than
# gateway.fairness.SLICE: for a 10,000-message send on a loaded 2-core machine, 64
# gave another protocol's p99 round trip 0.7-3 ms (256: 5-13 ms) and took half as
# long as 32 (docs/rocketmq.md, Hostile input).
APPEND_SLICE = 64


def _queue_for(rt: RocketMQServices, info: TopicInfo, message: Message) -> QueueRef:
    count = max(1, info.config.queue_count)
    if message.message_group is not None:
        queue_id = zlib.crc32(message.message_group.encode()) % count
    else:
        queue_id = rt.rotate() % count
    return QueueRef(info.namespace, info.name, queue_id)


async def send_message(rt: RocketMQServices, request: Any, context: Any) -> Any:
    """A batch is checked whole before anything is stored (a bad message fails the
    send, not half of it), then appended slice by slice, handing the event loop back
    between slices: a batch of ``limits.max_batch_items`` delays every other
    connection by one slice, not by the whole batch. A failure after the first slice
    leaves the earlier slices stored; the client's retry of the whole batch stores them
    once, by their message ids."""
    count = len(request.messages)
    if not count:
        raise RpcFailure(Code.BAD_REQUEST, "no message to send")
    limit = rt.config.limits.max_batch_items
    if count > limit:
        raise RpcFailure(
            Code.PAYLOAD_TOO_LARGE, f"a send carries at most {limit} messages, got {count}"
        )
    first = request.messages[0].topic
    caller = rt.caller(context, first.resource_namespace)
    await rt.processor.authorize(caller, "topic", first.name, "write")
    quota.admit(rt, caller, "produce", sum(len(pb.body) for pb in request.messages))
    message_type = mapping.message_type_of(request.messages[0])
    if message_type is MessageType.TRANSACTION and count != 1:
        raise RpcFailure(Code.BAD_REQUEST, "a transaction holds one message")
    now = rt.processor.clock.now_ms()
    messages: list[Message] = []
    async for pb in cooperatively(request.messages):  # checked before the topic is created
        if pb.topic.name != first.name:
            raise RpcFailure(Code.BAD_REQUEST, "a batch must go to one topic")
        if mapping.message_type_of(pb) is not message_type:
            raise RpcFailure(
                Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a batch mixes message types"
            )
        messages.append(
            mapping.from_proto(
                pb,
                max_body_bytes=rt.max_body_bytes,
                now_ms=now,
                max_delay_ms=rt.options.max_delay_ms,
            )
        )
    info = await rt.topic(caller, first.name, create_as=message_type)
    if info.config.message_type != message_type:
        raise RpcFailure(
            Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
            f"topic {first.name!r} accepts {info.config.message_type.value} messages, "
            f"not {message_type.value}",
        )

    def append_request(pb: Any, message: Message) -> AppendRequest:
        message_id = pb.system_properties.message_id
        return AppendRequest(
            entry=message,
            queues=(_queue_for(rt, info, message),),
            dedup_key=f"rocketmq:{message_id}" if message_id else None,
            durable=rt.sync_flush,
        )

    if message_type is MessageType.TRANSACTION:
        request_one = append_request(request.messages[0], messages[0])
        half = await rt.processor.append_half(caller, request_one, producer_group=first.name)
        entry = service_pb2.SendResultEntry(
            status=ok(), message_id=half.message_id, transaction_id=half.transaction_id
        )
        return service_pb2.SendMessageResponse(status=ok(), entries=[entry])
    entries = []
    async for part in slices_between(count, APPEND_SLICE):
        # built slice by slice too: 10,000 requests built at once held the loop ~50 ms
        sliced = messages[part]
        pbs = request.messages[part]
        chunk = [append_request(pb, m) for pb, m in zip(pbs, sliced, strict=True)]
        results = await rt.processor.append(caller, chunk)
        for message, result in zip(sliced, results, strict=True):
            entries.append(
                service_pb2.SendResultEntry(
                    status=ok(),
                    message_id=result.message_id,
                    offset=result.placements[0].offset if result.placements else 0,
                    recall_handle=result.message_id if message.delivery_time_ms else "",
                )
            )
    return service_pb2.SendMessageResponse(status=ok(), entries=entries)


async def recall_message(rt: RocketMQServices, request: Any, context: Any) -> Any:
    """The recall handle is the delayed message's id (given back on send)."""
    caller = rt.caller(context, request.topic.resource_namespace)
    if not request.recall_handle:
        raise RpcFailure(Code.BAD_REQUEST, "recall handle is empty")
    if not await rt.processor.cancel_delayed(caller, request.recall_handle):
        raise RpcFailure(
            Code.NOT_FOUND, "no delayed message pending for this recall handle (delivered?)"
        )
    return service_pb2.RecallMessageResponse(status=ok(), message_id=request.recall_handle)
