"""Message expiry: per-queue TTL (``x-message-ttl``) and per-message ``expiration``.

Consumers and basic.get check expiry as they deliver (:func:`expires_at`). Without a
consumer in this gateway, the sweeper of a TTL queue removes what expired at the queue
head (dead-lettered when the queue has ``x-dead-letter-exchange``) about when it
expires, as RabbitMQ does. It *peeks* at the head with an offset read from the
group's acked prefix, so a message it looks at and leaves is not delivered: its next
consumer sees it as a first delivery (``redelivered`` false). Only messages the peek
saw expired are popped, and dead-lettered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from polymq.gateway.processor import Caller
from polymq.protocols.amqp.dead_letter import dead_letter
from polymq.protocols.amqp.definitions import VhostView
from polymq.protocols.amqp.publishing import EXPIRES_AT
from polymq.protocols.amqp.queues import QueueDef
from polymq.storage.errors import StorageError
from polymq.storage.model import QueueRef, StoredMessage

__all__ = ["expires_at", "sweep_expired", "sweep_once"]

log = logging.getLogger(__name__)

_IDLE_S: Final = 1.0
_HOLD_MS: Final = 60_000
_PEEK: Final = 64  # messages looked at per storage queue and pass
_FIRST_LOOK_MIN_S: Final = 0.1


def expires_at(queue: QueueDef, stored: StoredMessage) -> int | None:
    """When ``stored`` expires in ``queue`` (ms since the epoch), if it does: the
    earlier of the queue's TTL and the message's own ``expiration``."""
    ttl = queue.int_argument("x-message-ttl")
    at = stored.store_timestamp_ms + ttl if ttl is not None else None
    own = stored.message.property(EXPIRES_AT)
    if own is not None:
        at = int(own) if at is None else min(at, int(own))
    return at


async def sweep_once(caller: Caller, vhost: VhostView, queue: QueueDef) -> int | None:
    """One pass over the queue's heads: remove what has expired. Returns when the
    next head expires (ms since the epoch), ``None`` if the queue is empty."""
    due: int | None = None
    async with queue.sweeping:  # one sweep of a queue at a time in this gateway
        for ref in queue.refs(vhost.namespace):
            at = await _sweep_head(caller, vhost, queue, ref)
            if at is not None and (due is None or at < due):
                due = at
    return due


async def _sweep_head(
    caller: Caller, vhost: VhostView, queue: QueueDef, ref: QueueRef
) -> int | None:
    processor = vhost.processor
    head = await processor.consumed_below(caller, queue.group, ref)
    peeked = await processor.read(caller, ref, head, max_messages=_PEEK, metered=False)
    now = processor.clock.now_ms()
    expired = 0
    due: int | None = None
    limit = peeked.next_offset  # the first offset the peek did not see expired
    for stored in peeked.messages:
        at = expires_at(queue, stored)
        if at is None or at > now:
            due, limit = at, stored.offset
            break
        expired += 1
    if not expired:
        return due
    # The peek also saw messages that are not ready: delivered and unacked, or acked
    # out of order. Pop no more than the expired ones that must be ready, so every
    # message popped is one the peek saw expired (pop takes the lowest ready offsets).
    bounds = await processor.queue_offsets(caller, ref)
    pending = await processor.pending_count(caller, queue.group, ref)
    inflight = await processor.inflight_count(caller, queue.group, ref)
    acked_beyond = max(0, bounds.latest - head - pending)
    ready_expired = expired - inflight - acked_beyond
    if ready_expired <= 0:
        return due
    if expired == len(peeked.messages):
        due = now  # everything peeked expired: look again at once
    popped = await processor.pop(
        caller, queue.group, [ref], max_messages=ready_expired, invisible_ms=_HOLD_MS
    )
    vhost.requeued.taken(popped)
    for stored in popped:
        if stored.offset < limit:
            await dead_letter(processor, caller, vhost, queue, stored, "expired")
        else:  # the peek's expired ones were taken meanwhile (unacked deliveries)
            with contextlib.suppress(StorageError):
                await processor.nack(caller, queue.group, stored.receipt or "")
                vhost.requeued.given_back(stored)
    return due


async def sweep_expired(
    caller: Caller, vhost: VhostView, queue: QueueDef, first_look_ms: int = 0
) -> None:
    """The sweeper of a queue: while it exists if it has a TTL (``x-message-ttl``),
    else (started for a message with ``expiration``) until the head does not expire.
    ``first_look_ms``: when to look first, as the message that started it is on its
    way to storage."""
    ttl = queue.int_argument("x-message-ttl")
    processor = vhost.processor
    idle = min(_IDLE_S, max(0.05, ttl / 1000)) if ttl is not None else _IDLE_S
    await asyncio.sleep(max(_FIRST_LOOK_MIN_S, first_look_ms / 1000) if ttl is None else 0)
    while vhost.queues.get(queue.name) is queue:
        if queue.consumers or queue.registry:  # consumers drop what expired as they go
            await asyncio.sleep(idle)
            continue
        try:
            due = await sweep_once(caller, vhost, queue)
        except StorageError as e:
            if vhost.queues.get(queue.name) is not queue:
                return  # deleted under us
            log.warning("amqp: expiry of queue %s failed: %s", queue.name, e)
            await asyncio.sleep(_IDLE_S)
            continue
        if due is None:
            if ttl is None:
                return  # empty, or its head does not expire (RabbitMQ looks at heads only)
            await asyncio.sleep(idle)
        else:
            await asyncio.sleep(min(_IDLE_S, max(0.0, (due - processor.clock.now_ms()) / 1000)))
