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

from protocols.rocketmq import mapping
from protocols.rocketmq.runtime import Runtime
from protocols.rocketmq.status import RpcFailure, ok
from storage.model import AppendRequest, Message, MessageType, QueueRef, TopicInfo

__all__ = ["recall_message", "send_message"]


def _queue_for(rt: Runtime, info: TopicInfo, message: Message) -> QueueRef:
    count = max(1, info.config.queue_count)
    if message.message_group is not None:
        queue_id = zlib.crc32(message.message_group.encode()) % count
    else:
        queue_id = rt.rotate() % count
    return QueueRef(info.namespace, info.name, queue_id)


async def send_message(rt: Runtime, request: Any, context: Any) -> Any:
    if not request.messages:
        raise RpcFailure(Code.BAD_REQUEST, "no message to send")
    first = request.messages[0].topic
    if any(m.topic.name != first.name for m in request.messages):
        raise RpcFailure(Code.BAD_REQUEST, "a batch must go to one topic")
    caller = rt.caller(context, first.resource_namespace)
    types = {mapping.message_type_of(m) for m in request.messages}
    if len(types) != 1:
        raise RpcFailure(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a batch mixes message types")
    [message_type] = types
    now = rt.processor.clock.now_ms()
    messages = [  # checked before the topic is created for them
        mapping.from_proto(
            pb, max_body_bytes=rt.max_body_bytes, now_ms=now, max_delay_ms=rt.options.max_delay_ms
        )
        for pb in request.messages
    ]
    info = await rt.topic(caller, first.name, create_as=message_type)
    if info.config.message_type != message_type:
        raise RpcFailure(
            Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
            f"topic {first.name!r} accepts {info.config.message_type.value} messages, "
            f"not {message_type.value}",
        )
    if message_type is MessageType.TRANSACTION and len(request.messages) != 1:
        raise RpcFailure(Code.BAD_REQUEST, "a transaction holds one message")
    requests = [
        AppendRequest(
            entry=message,
            queues=(_queue_for(rt, info, message),),
            dedup_key=f"rocketmq:{pb.system_properties.message_id}"
            if pb.system_properties.message_id
            else None,
        )
        for pb, message in zip(request.messages, messages, strict=True)
    ]
    entries = []
    if message_type is MessageType.TRANSACTION:
        half = await rt.processor.append_half(caller, requests[0], producer_group=first.name)
        entries.append(
            service_pb2.SendResultEntry(
                status=ok(), message_id=half.message_id, transaction_id=half.transaction_id
            )
        )
    else:
        results = await rt.processor.append(caller, requests)
        for message, result in zip(messages, results, strict=True):
            entries.append(
                service_pb2.SendResultEntry(
                    status=ok(),
                    message_id=result.message_id,
                    offset=result.placements[0].offset if result.placements else 0,
                    recall_handle=result.message_id if message.delivery_time_ms else "",
                )
            )
    return service_pb2.SendMessageResponse(status=ok(), entries=entries)


async def recall_message(rt: Runtime, request: Any, context: Any) -> Any:
    """The recall handle is the delayed message's id (given back on send)."""
    caller = rt.caller(context, request.topic.resource_namespace)
    if not request.recall_handle:
        raise RpcFailure(Code.BAD_REQUEST, "recall handle is empty")
    if not await rt.processor.cancel_delayed(caller, request.recall_handle):
        raise RpcFailure(
            Code.NOT_FOUND, "no delayed message pending for this recall handle (delivered?)"
        )
    return service_pb2.RecallMessageResponse(status=ok(), message_id=request.recall_handle)
