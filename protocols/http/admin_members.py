"""Who consumes for a group beyond Kafka's classic groups (docs/admin.md), from what
the gateways store for every gateway to read, so any gateway answers the same:

- AMQP: plain queues are popped by the group ``amqp``, a view (``x-polymq-topic``)
  by ``amqp:<queue>``; the members are the queues' consumers (``amqp.consumer``
  metadata), the lag per queue its ready plus unacked messages.
- MQTT: every session and shared-subscription queue is popped by the group ``mqtt``;
  the members are the shared subscriptions of the sessions storage keeps (``mqtt.session``
  metadata: sessions with an expiry), the lag per shared queue what it still holds.

- RocketMQ: the clients connected to this gateway whose settings name the group
  (the connection registry's ``group``): like ``/admin/connections``, per gateway.

What is not stored cannot be shown: MQTT sessions without an expiry live in one
gateway's memory only (see docs/admin.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polymq.gateway.connections import Connection
from polymq.gateway.processor import Caller, Processor
from polymq.protocols.amqp.queues import GROUP as AMQP_GROUP
from polymq.protocols.amqp.queues import TOPIC_PREFIX as AMQP_PREFIX
from polymq.protocols.http.admin_amqp import amqp_queues
from polymq.protocols.mqtt.model import POP_GROUP as MQTT_GROUP
from polymq.protocols.mqtt.model import SESSION_KIND, SHARED_PREFIX, queue_topic
from polymq.protocols.mqtt.topic_filter_index import split_shared
from polymq.storage.errors import QueueNotFound, TopicNotFound
from polymq.storage.model import QueueRef

__all__ = ["Members", "connected_members", "members_of"]

# (queues: lag per queue, members)
Members = tuple[list[dict[str, Any]], list[dict[str, Any]]]


async def members_of(
    processor: Processor,
    caller: Caller,
    group: str,
    *,
    self_id: str,
    local: Mapping[int, Connection],
) -> Members | None:
    """The queues and members of an AMQP or MQTT pop group; ``None`` for any other.
    ``local``: this gateway's connections by id, for the address of a consumer
    connected here (``self_id``: this gateway's id)."""
    if group == AMQP_GROUP or group.startswith(AMQP_PREFIX):
        return await _amqp(processor, caller, group, self_id, local)
    if group == MQTT_GROUP:
        return await _mqtt(processor, caller)
    return None


def connected_members(
    group: str, namespace: str, self_id: str, local: Mapping[int, Connection]
) -> list[dict[str, Any]]:
    """The clients connected to this gateway that told it they consume for ``group``
    (RocketMQ consumers' settings)."""
    return [
        {
            "protocol": c.protocol,
            "member_id": c.client_id,
            "client_id": c.client_id,
            "client_host": c.peer,
            "gateway": self_id,
            "connection_id": c.id,
        }
        for c in sorted(local.values(), key=lambda c: c.id)
        if c.group == group and c.namespace == namespace
    ]


async def _amqp(
    processor: Processor,
    caller: Caller,
    group: str,
    self_id: str,
    local: Mapping[int, Connection],
) -> Members:
    rows: list[dict[str, Any]] = []
    members: list[dict[str, Any]] = []
    for q in await amqp_queues(processor, caller):
        if q["group"] != group:
            continue
        rows.append(
            {
                "kind": "amqp",
                "queue": q["name"],
                "topic": q["topic"],
                "ready": q["messages_ready"],
                "unacked": q["messages_unacked"],
                "lag": q["messages_ready"] + q["messages_unacked"],
                "consumers": q["consumer_count"],
            }
        )
        for c in q["consumers"]:
            here = local.get(c["connection_id"]) if c["gateway"] == self_id else None
            members.append(
                {
                    "protocol": "amqp",
                    "member_id": c["id"],
                    "client_id": c["consumer_tag"],
                    "client_host": here.peer if here is not None else None,
                    "queue": q["name"],
                    "gateway": c["gateway"],
                    "connection_id": c["connection_id"],
                    "channel": c["channel"],
                    "exclusive": c["exclusive"],
                }
            )
    return rows, members


async def _mqtt(processor: Processor, caller: Caller) -> Members:
    shared: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for client_id, record in (await processor.meta_list(caller, SESSION_KIND)).items():
        if not isinstance(record, dict):
            continue
        for topic_filter in record.get("subs") or {}:
            try:
                found = split_shared(topic_filter)
            except ValueError:
                continue
            if found is None:
                continue
            shared.setdefault(found, []).append(
                {
                    "protocol": "mqtt",
                    "member_id": client_id,
                    "client_id": client_id,
                    "client_host": None,
                    "share_group": found[0],
                    "filter": found[1],
                    "connected": record.get("disconnected_ms") is None,
                    "gateway": record.get("gateway"),
                }
            )
    rows: list[dict[str, Any]] = []
    members: list[dict[str, Any]] = []
    for (name, inner), listed in sorted(shared.items()):
        ref = QueueRef(caller.namespace, queue_topic(SHARED_PREFIX, f"{name}/{inner}"), 0)
        try:
            pending = await processor.pending_count(caller, MQTT_GROUP, ref)
            inflight = await processor.inflight_count(caller, MQTT_GROUP, ref)
        except (TopicNotFound, QueueNotFound):
            pending = inflight = 0
        rows.append(
            {
                "kind": "mqtt-shared",
                "queue": f"$share/{name}/{inner}",
                "topic": ref.topic,
                "ready": max(0, pending - inflight),
                "unacked": inflight,
                "lag": pending,
                "consumers": len(listed),
            }
        )
        members.extend(sorted(listed, key=lambda m: str(m["client_id"])))
    return rows, members
