"""The admin API's view of AMQP queues (docs/admin.md), read from what every gateway
stores for them rather than from one gateway's memory, so any gateway shows the same:
the definitions, bindings and consumers are the metadata kinds of
:mod:`protocols.amqp.definitions`, and the message counts come from the queue's pop
group as ``queue.declare-ok`` counts them (ready: not yet delivered; unacked:
delivered and not yet acknowledged)."""

from __future__ import annotations

from typing import Any

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.amqp.definitions import BINDING, CONSUMER, QUEUE
from polymq.protocols.amqp.queues import QueueDef
from polymq.storage.errors import QueueNotFound, TopicNotFound
from polymq.storage.model import QueueRef

__all__ = ["amqp_consumer", "amqp_queues"]


def amqp_consumer(consumer_id: str, value: dict[str, Any]) -> dict[str, Any]:
    """A stored consumer as people read it. Its id is
    ``<gateway instance>/<connection id>:<object>/<channel>/<consumer tag>``
    (protocols/amqp/connection.py and consumer.py), the connection id being the one
    ``/admin/connections`` lists on that gateway."""
    instance, _, rest = consumer_id.partition("/")
    connection, _, rest = rest.partition("/")
    channel, _, tag = rest.partition("/")
    number = connection.partition(":")[0]
    return {
        "id": consumer_id,
        "gateway": str(value.get("instance") or instance).partition("#")[0],
        "connection_id": int(number) if number.isdigit() else None,
        "channel": int(channel) if channel.isdigit() else None,
        "consumer_tag": tag,
        "exclusive": bool(value.get("exclusive")),
    }


async def _refs(processor: Processor, caller: Caller, queue: QueueDef) -> tuple[QueueRef, ...]:
    """The storage queues holding ``queue``'s messages: a view's are its topic's."""
    if queue.view_topic is not None:
        info = await processor.describe_topic(caller, queue.view_topic)
        queue.view_queues = len(info.queues)
    return queue.refs(caller.namespace)


async def _counts(processor: Processor, caller: Caller, queue: QueueDef) -> tuple[int, int]:
    """(ready, unacked). A message nacked with requeue is counted unacked until it is
    delivered again: only the gateway holding it knows it is ready meanwhile."""
    ready = unacked = 0
    try:
        for ref in await _refs(processor, caller, queue):
            pending = await processor.pending_count(caller, queue.group, ref)
            inflight = await processor.inflight_count(caller, queue.group, ref)
            ready += max(0, pending - inflight)
            unacked += inflight
    except (TopicNotFound, QueueNotFound):
        pass  # declared, nothing published yet (or deleted meanwhile)
    return ready, unacked


async def amqp_queues(processor: Processor, caller: Caller) -> list[dict[str, Any]]:
    """The namespace's AMQP queues (its vhost's), with counts, consumers and bindings."""
    stored = await processor.meta_list(caller, QUEUE)
    if not stored:
        return []
    consumers: dict[str, list[dict[str, Any]]] = {}
    for consumer_id, value in (await processor.meta_list(caller, CONSUMER)).items():
        if isinstance(value, dict):
            consumers.setdefault(str(value.get("queue")), []).append(
                amqp_consumer(consumer_id, value)
            )
    bindings: dict[str, list[dict[str, Any]]] = {}
    for value in (await processor.meta_list(caller, BINDING)).values():
        if isinstance(value, dict) and not value.get("to_exchange"):
            bindings.setdefault(str(value.get("destination")), []).append(
                {
                    "exchange": value.get("source"),
                    "routing_key": value.get("routing_key"),
                    "arguments": dict(value.get("arguments") or []),
                }
            )
    shown = []
    for name in sorted(stored):
        queue = QueueDef.from_json(name, stored[name])
        ready, unacked = await _counts(processor, caller, queue)
        mine = sorted(consumers.get(name, []), key=lambda c: str(c["id"]))
        shown.append(
            {
                "kind": "amqp",
                "namespace": caller.namespace,
                "name": name,
                "durable": queue.durable,
                "exclusive": queue.exclusive_owner is not None,
                "auto_delete": queue.auto_delete,
                "arguments": queue.arguments,
                "topic": queue.topic,
                "group": queue.group,
                "messages_ready": ready,
                "messages_unacked": unacked,
                "consumer_count": len(mine),
                "consumers": mine,
                "bindings": sorted(
                    bindings.get(name, []),
                    key=lambda b: (str(b["exchange"]), str(b["routing_key"])),
                ),
            }
        )
    return shown
