"""Dead-lettering (RabbitMQ's ``x-dead-letter-exchange``): a rejected, expired or
overflowed message is republished to the queue's dead-letter exchange with an
``x-death`` header saying where it died and why, then removed from its queue.
"""

from __future__ import annotations

import datetime
from typing import Any

from pamqp import commands

from polymq.gateway.processor import Caller, Processor
from polymq.protocols import interop
from polymq.protocols.amqp.definitions import VhostView
from polymq.protocols.amqp.properties import (
    RAW_PROPERTIES,
    decode_properties,
    encode_properties,
    to_message,
)
from polymq.protocols.amqp.queues import QueueDef
from polymq.storage.model import AppendRequest, StoredMessage

__all__ = ["add_death", "dead_letter"]


def add_death(
    properties: commands.Basic.Properties,
    *,
    queue: str,
    reason: str,
    exchange: str,
    routing_keys: list[str],
    now: datetime.datetime,
) -> commands.Basic.Properties:
    """``properties`` with this death counted in ``x-death`` (one entry per queue and
    reason, most recent first, as RabbitMQ keeps it) and ``expiration`` removed."""
    headers: dict[str, Any] = dict(properties.headers or {})
    deaths: list[Any] = list(headers.get("x-death") or [])
    previous = next(
        (
            d
            for d in deaths
            if isinstance(d, dict) and d.get("queue") == queue and d.get("reason") == reason
        ),
        None,
    )
    if previous is not None:  # the same death again: count it, keep what it recorded
        deaths.remove(previous)
        entry = {**previous, "count": int(previous.get("count", 0)) + 1}
    else:
        entry = {
            "count": 1,
            "reason": reason,
            "queue": queue,
            "exchange": exchange,
            "routing-keys": list(routing_keys),
        }
        if properties.expiration:
            entry["original-expiration"] = properties.expiration
    entry["time"] = now.replace(microsecond=0)
    deaths.insert(0, entry)
    headers["x-death"] = deaths
    headers.setdefault("x-first-death-queue", queue)
    headers.setdefault("x-first-death-reason", reason)
    headers.setdefault("x-first-death-exchange", exchange)
    headers["x-last-death-queue"] = queue
    headers["x-last-death-reason"] = reason
    headers["x-last-death-exchange"] = exchange
    values = {name: getattr(properties, name) for name in commands.Basic.Properties.__slots__}
    values.update(headers=headers, expiration=None)
    return commands.Basic.Properties(**values)


async def dead_letter(
    processor: Processor,
    caller: Caller,
    vhost: VhostView,
    queue: QueueDef,
    stored: StoredMessage,
    reason: str,
) -> None:
    """Republish ``stored`` to ``queue``'s dead-letter exchange (if it has one that
    exists), then ack it: at-least-once, as RabbitMQ without quorum queues."""
    target = queue.arguments.get("x-dead-letter-exchange")
    if isinstance(target, str) and target in vhost.exchanges:
        message = stored.message
        raw = message.property(RAW_PROPERTIES)
        properties = decode_properties(raw) if raw is not None else commands.Basic.Properties()
        exchange = (message.property(interop.AMQP_EXCHANGE) or b"").decode(errors="replace")
        routing_key = (message.property(interop.AMQP_ROUTING_KEY) or b"").decode(errors="replace")
        new_key = queue.arguments.get("x-dead-letter-routing-key")
        new_key = new_key if isinstance(new_key, str) else routing_key
        properties = add_death(
            properties,
            queue=queue.name,
            reason=reason,
            exchange=exchange,
            routing_keys=[routing_key],
            now=datetime.datetime.fromtimestamp(processor.clock.now_ms() / 1000, datetime.UTC),
        )
        dlx = vhost.exchanges[target]
        names = [
            n
            for n in vhost.route(dlx, new_key, properties.headers)
            if n != queue.name or reason != "expired"
        ]
        if names:
            copy = to_message(
                exchange=target,
                routing_key=new_key,
                properties=properties,
                raw_properties=encode_properties(properties),
                body=message.body,
            )
            refs = tuple(
                vhost.queues[n].ref_for(vhost.namespace, properties.priority) for n in names
            )
            await processor.append(caller, [AppendRequest(entry=copy, queues=refs)])
    if stored.receipt is not None:
        await processor.ack(caller, queue.group, stored.receipt)
