"""Tails for the MQTT broker of a namespace: what other protocols (and, with several
gateways, the other gateways) store under the storage topics its filters reach.

A filter's literal first level names one storage topic; a filter starting with a
wildcard reaches every storage topic of the namespace, so while one exists the
topics are listed every few seconds and each is tailed (protocols/mqtt/topic_tail.py).
"""

from __future__ import annotations

import asyncio
import logging

from polymq.protocols.mqtt.core import BrokerCore, cancel_and_wait
from polymq.protocols.mqtt.mapping import storage_topic
from polymq.protocols.mqtt.routing import Router
from polymq.protocols.mqtt.topic_filter_index import split_shared
from polymq.protocols.mqtt.topic_tail import TAIL_GROUP, TopicTail
from polymq.storage.errors import StorageError

__all__ = ["Tails"]

log = logging.getLogger(__name__)

_DISCOVER_S = 2.0  # how often wildcard filters look for new storage topics


class Tails:
    """The tails a namespace's filters need, counted per storage topic."""

    def __init__(self, core: BrokerCore, router: Router) -> None:
        self.core = core
        self.router = router
        self._tails: dict[str, TopicTail] = {}
        self._refs: dict[str, int] = {}  # storage topic -> filters reaching it
        self._wild_refs = 0  # filters whose first level is a wildcard: they reach all
        self._discovery: asyncio.Task[None] | None = None
        self._discovered = asyncio.Event()

    async def count(self, topic_filter: str) -> None:
        """Keep a tail on the storage topic a filter's literal first level names, or
        on every storage topic of the namespace for a filter starting with a
        wildcard."""
        first = topic_filter.split("/", 1)[0]
        if first in ("+", "#"):
            self._wild_refs += 1
            if self._discovery is None or self._discovery.done():
                self._discovered.clear()
                self._discovery = self.core.tasks.spawn(self._discover())
            await self._discovered.wait()
            return
        topic = storage_topic(topic_filter)
        self._refs[topic] = self._refs.get(topic, 0) + 1
        await self._tail(topic).ready()

    def _tail(self, topic: str, *, from_start: bool = False) -> TopicTail:
        tail = self._tails.get(topic)
        if tail is None or tail.done():

            def wanted() -> bool:
                return topic in self._refs or (self._wild_refs > 0 and _public(topic))

            peers = self.core.peers
            tail = TopicTail(
                self.core.processor,
                self.core.caller,
                topic,
                lambda stored, live: self.router.route_tail(topic, stored, live),
                wanted,
                from_start=from_start,
                # Several gateways: each follows for its own clients, at its own position.
                group=TAIL_GROUP if peers is None else f"{TAIL_GROUP}.{peers.self_id}",
                keep=self.router.tailed,
                hold=self.router.repairs.hold,
                own=self.router.own,
            )
            self._tails[topic] = tail
            tail.start()
        return tail

    async def _discover(self) -> None:
        """While some filter starts with a wildcard, tail every storage topic of the
        namespace (not ``$`` ones, which wildcards do not match, v5 4.7.2): listed
        every few seconds, so an append costs nothing more. A topic found after the
        first listing is new, and is tailed from its start."""
        first = True
        try:
            while self._wild_refs > 0:
                try:
                    names = [
                        t.name for t in await self.core.processor.list_topics(self.core.caller)
                    ]
                except StorageError as e:
                    log.warning("mqtt: listing the topics of %s: %s", self.core.namespace, e)
                    names = []
                tails = [self._tail(n, from_start=not first) for n in names if _public(n)]
                for tail in tails:
                    await tail.ready()
                first = False
                self._discovered.set()
                await asyncio.sleep(_DISCOVER_S)
        finally:
            self._discovered.set()  # a subscriber never waits for a discovery that ended

    def uncount(self, topic_filter: str) -> None:
        if topic_filter.split("/", 1)[0] in ("+", "#"):
            self._wild_refs -= 1
            return
        topic = storage_topic(topic_filter)
        refs = self._refs.get(topic, 0) - 1
        if refs > 0:
            self._refs[topic] = refs
        else:
            self._refs.pop(topic, None)

    def follows(self, client_id: str, topic_filter: str) -> bool:
        """Whether this gateway routes what is published to ``topic_filter`` for
        ``client_id``'s subscription, its tail included (the admin view, tests)."""
        session = self.core.sessions.get(client_id)
        if session is None or topic_filter not in session.subscriptions:
            return False
        shared = split_shared(topic_filter)
        inner = shared[1] if shared else topic_filter
        if inner.split("/", 1)[0] in ("+", "#"):
            return self._discovered.is_set()
        tail = self._tails.get(storage_topic(inner))
        return tail is not None and tail.is_ready()

    def messages_read(self, topic: str) -> int:
        """How many messages the tail of a storage topic read from storage so far
        (the router's own publishes it skipped unread are not counted)."""
        tail = self._tails.get(topic)
        return tail.messages_read if tail is not None else 0

    async def close(self) -> None:
        """Stop discovering and tailing (server stop)."""
        discovery, self._discovery = self._discovery, None
        await cancel_and_wait(discovery)
        tails = list(self._tails.values())
        self._tails.clear()
        for tail in tails:
            await tail.stop()


def _public(topic: str) -> bool:
    """A storage topic wildcard filters reach (not ``$SYS``-like or ours)."""
    return not topic.startswith("$")
