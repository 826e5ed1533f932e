"""ReceiveMessage: pop-mode consumption for simple and push consumers.

A receive pops across every queue of the topic (whatever queue the client named), so
one long poll sees a message wherever it lands; storage keeps FIFO groups in order
and hands out redeliveries first. The answer is a server stream: a status, the
delivery timestamp, then the messages; or MESSAGE_NOT_FOUND when the long poll ends
empty (the clients treat that as "nothing yet", not an error).

Tag filters go down to storage; SQL92 filters are checked here, and messages that
fail them are acked for the group, as RocketMQ's filtered messages are consumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import timestamp_pb2
from rocketmq.grpc_protocol import Code, service_pb2

from polymq.gateway.processor import Caller
from polymq.protocols.rocketmq import mapping, quota
from polymq.protocols.rocketmq.filters import MATCH_ALL, Filter
from polymq.protocols.rocketmq.runtime import RocketMQServices
from polymq.protocols.rocketmq.status import RpcFailure, ok, status
from polymq.storage.model import StoredMessage, TopicInfo

__all__ = ["duration_ms", "receive_message"]

# Answer this long before the client's deadline, so the answer arrives in time.
_DEADLINE_MARGIN_MS = 500
_TOPIC_POLL_S = 0.5


def duration_ms(value: Any) -> int:
    return int(value.seconds) * 1000 + int(value.nanos) // 1_000_000


def _invisible_ms(rt: RocketMQServices, request: Any) -> int:
    if request.auto_renew or not request.HasField("invisible_duration"):
        return rt.options.default_invisible_ms
    invisible = duration_ms(request.invisible_duration)
    if not rt.options.min_invisible_ms <= invisible <= rt.options.max_invisible_ms:
        raise RpcFailure(
            Code.ILLEGAL_INVISIBLE_TIME,
            f"invisible duration must be within [{rt.options.min_invisible_ms}, "
            f"{rt.options.max_invisible_ms}] ms, got {invisible}",
        )
    return invisible


def _long_polling_ms(rt: RocketMQServices, request: Any, context: Any) -> int:
    wait = (
        duration_ms(request.long_polling_timeout)
        if request.HasField("long_polling_timeout")
        else rt.options.long_polling_ms
    )
    wait = min(max(wait, 0), rt.options.max_long_polling_ms)
    remaining = context.time_remaining()
    if remaining is not None:
        wait = min(wait, int(remaining * 1000) - _DEADLINE_MARGIN_MS)
    return max(wait, 0)


def _filter(rt: RocketMQServices, request: Any, caller: Caller, topic: str) -> Filter:
    expression = request.filter_expression
    if expression.type or expression.expression:
        return rt.filter(expression.type, expression.expression)
    session = rt.sessions.get(caller.client_id) if caller.client_id else None
    return session.subscription(topic) if session is not None else MATCH_ALL


async def _wait_for_topic(
    rt: RocketMQServices, caller: Caller, topic: str, wait_ms: int
) -> TopicInfo | None:
    """A consumer may start before any producer created the topic: wait out the long
    poll for it to appear rather than create it with a guessed message type."""
    if not rt.auto_create:
        return await rt.topic(caller, topic, create_as=None)  # TOPIC_NOT_FOUND
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_ms / 1000
    while True:
        info = await rt.find_topic(caller, topic)
        if info is not None or loop.time() >= deadline:
            return info
        await asyncio.sleep(min(_TOPIC_POLL_S, max(0.0, deadline - loop.time())))


async def _pop(
    rt: RocketMQServices,
    caller: Caller,
    group: str,
    info: TopicInfo,
    selector: Filter,
    *,
    batch: int,
    invisible_ms: int,
    wait_ms: int,
) -> list[StoredMessage]:
    """One long poll in storage, which wakes on a new message, a redelivery coming due,
    and whatever releases a message (a FIFO ack, a nack): a message is handed out as
    soon as it may be. It loops only when every message popped failed a SQL92 filter.
    The hand-out is fsynced before the answer with ``rocketmq.flush = "sync"`` only:
    with ASYNC_FLUSH a power loss may hand a message out again before its invisible
    time ends (at least once still holds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_ms / 1000
    while True:
        remaining = max(0, int((deadline - loop.time()) * 1000))
        popped = await rt.processor.pop(
            caller,
            group,
            rt.queues(info),
            max_messages=batch,
            invisible_ms=invisible_ms,
            wait_ms=remaining,
            tags=selector.tags,
            durable=rt.sync_flush,
        )
        kept = (
            popped if selector.sql is None else [m for m in popped if selector.matches(m.message)]
        )
        dropped = [m.receipt for m in popped if m.receipt is not None and m not in kept]
        if dropped:
            await rt.processor.ack_many(caller, group, dropped, durable=rt.sync_flush)
        if kept or loop.time() >= deadline:
            return kept


async def receive_message(rt: RocketMQServices, request: Any, context: Any) -> AsyncIterator[Any]:
    caller = rt.caller(context, request.group.resource_namespace)
    quota.admit(rt, caller, "consume")
    group = request.group.name
    if not group:
        raise RpcFailure(Code.ILLEGAL_CONSUMER_GROUP, "consumer group is empty")
    topic = request.message_queue.topic.name
    if not topic:
        raise RpcFailure(Code.ILLEGAL_TOPIC, "topic is empty")
    await rt.processor.authorize(caller, "topic", topic, "read")
    invisible_ms = _invisible_ms(rt, request)
    batch = min(max(request.batch_size, 1), rt.options.max_batch_size)
    wait_ms = _long_polling_ms(rt, request, context)
    selector = _filter(rt, request, caller, topic)
    await rt.check_group(caller, group)
    info = await rt.find_topic(caller, topic)
    loop = asyncio.get_running_loop()
    started = loop.time()
    if info is None:
        info = await _wait_for_topic(rt, caller, topic, wait_ms)
    messages: list[StoredMessage] = []
    attempt = (caller.client_id, group, topic)
    attempt_id = request.attempt_id if request.HasField("attempt_id") else None
    previous = rt.receive_attempts.get(attempt)
    replayed = bool(attempt_id) and previous is not None and previous[0] == attempt_id
    if replayed and previous is not None:
        # The client retries a receive whose answer it lost (push consumers reuse the
        # attempt id then, as Apache's broker expects): serve that answer again rather
        # than leave its messages invisible (and a FIFO group blocked) meanwhile.
        messages = previous[1]
    elif info is not None:
        left = max(0, wait_ms - int((loop.time() - started) * 1000))
        messages = await _pop(
            rt, caller, group, info, selector, batch=batch, invisible_ms=invisible_ms, wait_ms=left
        )
    if attempt_id and caller.client_id is not None:
        rt.receive_attempts[attempt] = (attempt_id, messages)
    if not messages or info is None:
        yield service_pb2.ReceiveMessageResponse(
            status=status(Code.MESSAGE_NOT_FOUND, "no new message")
        )
        return
    quota.consumed(rt.quotas, caller, messages)
    if request.auto_renew and not replayed:
        for stored in messages:
            if stored.receipt is not None:
                rt.renewer.hold(caller, group, stored.receipt)
    yield service_pb2.ReceiveMessageResponse(status=ok())
    delivered = timestamp_pb2.Timestamp()
    delivered.FromMilliseconds(rt.processor.clock.now_ms())
    yield service_pb2.ReceiveMessageResponse(delivery_timestamp=delivered)
    for stored in messages:
        yield service_pb2.ReceiveMessageResponse(
            message=mapping.to_proto(
                stored,
                namespace=request.group.resource_namespace,
                message_type=info.config.message_type,
                store_host=rt.store_host,
                invisible_ms=invisible_ms,
            )
        )
