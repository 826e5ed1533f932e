"""Per-queue message TTL (``x-message-ttl``) enforced without consumers.

Consumers check expiry as they deliver; this sweeper runs while a TTL queue has no
consumer in this gateway, so expired messages still leave the queue (dead-lettered
when it has ``x-dead-letter-exchange``) about when they expire, as RabbitMQ does.
It looks at the head: an unexpired head is given back and the sweeper sleeps until
it expires (the message then counts one more delivery attempt: its next consumer
sees ``redelivered``, a known deviation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from gateway.processor import Caller
from protocols.amqp.dead_letter import dead_letter
from protocols.amqp.vhost import GROUP, QueueDef, VirtualHost
from storage.errors import StorageError

__all__ = ["sweep_expired"]

log = logging.getLogger(__name__)

_IDLE_S: Final = 1.0
_HOLD_MS: Final = 60_000


async def sweep_expired(caller: Caller, vhost: VirtualHost, queue: QueueDef) -> None:
    ttl = queue.int_argument("x-message-ttl")
    if ttl is None:
        return
    processor = vhost.processor
    refs = queue.refs(vhost.namespace)
    while vhost.queues.get(queue.name) is queue:
        if queue.consumers:
            await asyncio.sleep(min(_IDLE_S, max(0.05, ttl / 1000)))
            continue
        try:
            popped = await processor.pop(
                caller, GROUP, refs, max_messages=1, invisible_ms=_HOLD_MS, wait_ms=1000
            )
            if not popped:
                continue
            [stored] = popped
            now = processor.clock.now_ms()
            expires = stored.store_timestamp_ms + ttl
            if expires <= now:
                await dead_letter(processor, caller, vhost, queue, stored, "expired")
                continue
            with contextlib.suppress(StorageError):
                await processor.nack(caller, GROUP, stored.receipt or "")
            await asyncio.sleep((expires - now) / 1000)
        except StorageError as e:
            if vhost.queues.get(queue.name) is not queue:
                return  # deleted under us
            log.warning("amqp: expiry of queue %s failed: %s", queue.name, e)
            await asyncio.sleep(_IDLE_S)
