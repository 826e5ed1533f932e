"""What every part of one namespace's MQTT broker reads and changes: its sessions,
the subscription index, the storage topics it made, how far it followed the other
gateways, and the one set of background tasks the broker's close cancels.

The parts (sessions, subscriptions, routing, tails, peer events) each hold this and
the parts below them, so there is one copy of that state and no part imports one
above it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from polymq.gateway.accounts import Principal
from polymq.gateway.processor import Caller, Processor
from polymq.protocols.mqtt.model import Session, SharedGroup, SubOptions, topic_config
from polymq.protocols.mqtt.peers import EVENTS_TOPIC, Event, Peers, encode_event
from polymq.protocols.mqtt.topic_filter_index import TopicFilterIndex
from polymq.storage.errors import TopicAlreadyExists, TopicNotFound
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import AppendRequest, QueueRef

__all__ = ["ROUTE_RETRIES", "ROUTE_RETRY_S", "BrokerCore", "IndexEntry", "cancel_and_wait"]

# The separated form learns of a topic another gateway (or a concurrent create) just
# made from the storage nodes' next heartbeat: a few hundred milliseconds.
ROUTE_RETRIES = 50
ROUTE_RETRY_S = 0.2

IndexEntry = tuple[Session, SubOptions] | SharedGroup


class BrokerCore:
    """The state of one namespace's broker that its parts share."""

    def __init__(self, processor: Processor, namespace: str, peers: Peers | None) -> None:
        self.namespace = namespace
        self.processor = processor
        self.caller = Caller(
            principal=Principal(
                name="mqtt-broker",
                namespaces=frozenset({namespace}),
                default_namespace=namespace,
            ),
            namespace=namespace,
            protocol="mqtt",
        )
        self.sessions: dict[str, Session] = {}
        self.index: TopicFilterIndex[IndexEntry] = TopicFilterIndex()
        self.shared: dict[tuple[str, str], SharedGroup] = {}
        self.topics: set[str] = set()  # storage topics known to exist
        self.tasks = TaskSet(f"mqtt broker {namespace}")
        # Several gateways (None in the merged form): see protocols/mqtt/peers.py.
        self.peers = peers
        self.stamp = peers.self_id.encode() if peers is not None else b""
        self.events_queue = QueueRef(namespace, EVENTS_TOPIC, 0)
        self.applied = 0  # events offset: those below it are in this gateway's index

    async def ensure_topic(self, topic: str) -> None:
        """Create a storage topic on first use; ``InvalidName`` if none can be named so."""
        if topic in self.topics:
            return
        with contextlib.suppress(TopicAlreadyExists):
            await self.processor.create_topic(self.caller, topic, topic_config(topic))
        self.topics.add(topic)

    async def delete_topic(self, topic: str) -> None:
        """Delete a storage topic this broker made (gone already is fine)."""
        self.topics.discard(topic)
        with contextlib.suppress(TopicNotFound):
            await self.processor.delete_topic(self.caller, topic)

    async def emit(self, kind: str, **fields: Any) -> int:
        """Tell the other gateways: an :class:`Event` from this one appended to
        ``$mqtt.events``; returns its offset there."""
        assert self.peers is not None
        event = Event(kind=kind, origin=self.peers.self_id, **fields)
        message = encode_event(event, self.processor.clock.now_ms())
        request = AppendRequest(entry=message, queues=(self.events_queue,))
        (result,) = await self.processor.append(self.caller, [request], metered=False)
        return result.placements[0].offset if result.placements else 0

    async def queue_latest(self, queue: QueueRef) -> int:
        """The end offset of a queue of a topic that may have just been made by another
        gateway, so not yet be in this gateway's routes."""
        for _ in range(ROUTE_RETRIES):
            try:
                offsets = await self.processor.queue_offsets(self.caller, queue)
                return offsets.latest
            except TopicNotFound:
                await asyncio.sleep(ROUTE_RETRY_S)
        offsets = await self.processor.queue_offsets(self.caller, queue)
        return offsets.latest


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Stop one of the broker's loops before what it feeds stops (its other tasks end
    with the broker's task set, last)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
