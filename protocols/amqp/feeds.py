"""Feeds: what other protocols store in an exchange's topic reaches its bound queues.

An exchange ``T`` is the storage topic ``T`` (:mod:`protocols.amqp.natural`). AMQP's
own publishes are routed when published; a Kafka record, an MQTT publish, a RocketMQ
or MNS message stored in ``T`` is not, so each gateway serving the vhost pops ``T``
for every bound exchange with the exchange's own group (``amqp.feed:<exchange>``),
routes each message through the exchange's bindings with a routing key derived from
it (:func:`natural.feed_routing_key`), appends one copy per bound queue, then acks.
The group is shared by every gateway, so each message is routed by one of them: once
per bound queue, whatever the number of gateways (a gateway dying between the append
and the ack leaves the message to be routed again when its lease runs out: at least
once then, never lost).

A feed routes only what was stored after the exchange was first fed (a marker in the
vhost's metadata): binding a queue to ``orders`` does not replay a Kafka topic's
history into it, as RabbitMQ queues get only what is published after they are bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Final

from polymq.gateway.processor import Caller
from polymq.protocols import interop
from polymq.protocols.amqp.definitions import GROUP_CONFIG
from polymq.protocols.amqp.natural import AMQ_TOPIC, feed_routing_key
from polymq.protocols.amqp.properties import foreign_headers
from polymq.protocols.amqp.routing import Binding
from polymq.storage.errors import StorageError, TopicNotFound
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import AppendRequest, QueueRef, StoredMessage

if TYPE_CHECKING:
    from polymq.protocols.amqp.vhost import VirtualHost

__all__ = ["FEED_GROUP_PREFIX", "FEED_META", "Feeds"]

log = logging.getLogger(__name__)

FEED_GROUP_PREFIX: Final = "amqp.feed:"
FEED_META: Final = "amqp.feed"  # feed name -> {"since_ms": ...}
_REFRESH_S: Final = 0.5
_POP_MAX: Final = 256
_INVISIBLE_MS: Final = 30_000
_WAIT_MS: Final = 1_000
_RETRY_S: Final = 1.0


class Feeds:
    """The feeds of one vhost on this gateway: one task per (exchange, topic) the
    definitions ask for, started and stopped as bindings come and go."""

    def __init__(self, host: VirtualHost) -> None:
        self._host = host
        self._tasks = TaskSet(f"amqp feeds {host.namespace}")
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}

    def start(self, caller: Caller) -> None:
        self._tasks.spawn(self._follow_definitions(caller), name="amqp-feeds")

    async def close(self) -> None:
        await self._tasks.close()

    def feed_name(self, exchange: str, topic: str) -> str:
        """The feed's group, less :data:`FEED_GROUP_PREFIX`, and its marker's key:
        one per exchange, and for ``amq.topic`` one per topic it hears."""
        return f"{exchange}:{topic}" if exchange == AMQ_TOPIC else exchange

    async def bound(self, caller: Caller, binding: Binding) -> None:
        """A binding was made: from now on, what other protocols store in the
        exchange's topic is routed (the feed may start a moment later)."""
        host = self._host
        exchange = host.exchanges.get(binding.source)
        if exchange is None:
            return
        if binding.source == AMQ_TOPIC:
            topics = host.natural.amq_topic_sources([binding.routing_key])
        else:
            topic = host.natural.topic_of(binding.source, dict(exchange.arguments))
            topics = {topic} if topic is not None else set()
        for topic in topics:
            await self._since(caller, self.feed_name(binding.source, topic))

    def wanted(self) -> set[tuple[str, str]]:
        """(exchange, topic) for every exchange with bindings that is a topic."""
        host, defs = self._host, self._host.definitions
        wanted: set[tuple[str, str]] = set()
        for name, exchange in list(host.exchanges.items()):
            if not defs.has_bindings_from(name):
                continue
            if name == AMQ_TOPIC:
                keys = [b.routing_key for b in defs.bindings.values() if b.source == name]
                wanted.update((name, t) for t in host.natural.amq_topic_sources(keys))
                continue
            topic = host.natural.topic_of(name, dict(exchange.arguments))
            if topic is not None:
                wanted.add((name, topic))
        return wanted

    async def _follow_definitions(self, caller: Caller) -> None:
        while True:
            try:
                await self._refresh(caller)
            except StorageError as e:
                log.debug("amqp: feeds of %s not refreshed: %s", self._host.namespace, e)
            await asyncio.sleep(_REFRESH_S)

    async def _refresh(self, caller: Caller) -> None:
        wanted = self.wanted()
        for key in [k for k in self._running if k not in wanted]:
            self._running.pop(key).cancel()
        missing = [k for k in wanted if k not in self._running]
        if not missing:
            return
        existing = {t.name for t in await self._host.processor.list_topics(caller)}
        for key in missing:
            if key[1] in existing:
                self._running[key] = self._tasks.spawn(self._feed(caller, *key))

    async def _feed(self, caller: Caller, exchange: str, topic: str) -> None:
        name = self.feed_name(exchange, topic)
        processor, group = self._host.processor, FEED_GROUP_PREFIX + name
        host_ns = self._host.namespace
        try:
            since = await self._since(caller, name)
            await processor.set_group_config(caller, group, GROUP_CONFIG)
            refs: tuple[QueueRef, ...] = ()
            while True:
                try:
                    if not refs:
                        info = await processor.describe_topic(caller, topic)
                        refs = tuple(QueueRef(host_ns, topic, i) for i in range(len(info.queues)))
                    popped = await processor.pop(
                        caller,
                        group,
                        refs,
                        max_messages=_POP_MAX,
                        invisible_ms=_INVISIBLE_MS,
                        wait_ms=_WAIT_MS,
                    )
                    if not popped:
                        refs = ()  # look at the queue count again (partitions added)
                        continue
                    await self._route(caller, exchange, topic, popped, since)
                    await processor.ack_many(caller, group, [m.receipt or "" for m in popped])
                except TopicNotFound:
                    return  # the topic went; the next refresh starts a feed if it is back
                except StorageError as e:
                    log.debug("amqp: feed %s <- %s waits: %s", exchange, topic, e)
                    refs = ()
                    await asyncio.sleep(_RETRY_S)
        finally:
            if self._running.get((exchange, topic)) is asyncio.current_task():
                del self._running[(exchange, topic)]

    async def _since(self, caller: Caller, name: str) -> int:
        """When the feed was first asked for (its exchange's first binding): what was
        stored before is not routed."""
        processor = self._host.processor
        found = await processor.meta_get(caller, FEED_META, name)
        if isinstance(found, dict) and isinstance(found.get("since_ms"), int):
            return int(found["since_ms"])
        since = processor.clock.now_ms()
        await processor.meta_put(caller, FEED_META, name, {"since_ms": since})
        return since

    async def _route(
        self,
        caller: Caller,
        exchange_name: str,
        topic: str,
        popped: list[StoredMessage],
        since: int,
    ) -> None:
        host = self._host
        exchange = host.exchanges.get(exchange_name)
        if exchange is None:
            return
        requests: list[AppendRequest] = []
        for stored in popped:
            message = stored.message
            if message.property(interop.AMQP_EXCHANGE) is not None:
                continue  # AMQP's own publish: routed when it was published
            if stored.store_timestamp_ms < since:
                continue
            routing_key = feed_routing_key(exchange_name, topic, message)
            headers = foreign_headers(message)
            targets = []
            for name in host.route(exchange, routing_key, headers):
                queue = host.queues[name]
                if queue.view_topic == topic:
                    continue  # a view of this very topic reads it already
                targets.append(queue.ref_for(host.namespace, None))
            if not targets:
                continue
            copy = dataclasses.replace(
                message,
                properties=(
                    *message.properties,
                    (interop.AMQP_EXCHANGE, exchange_name.encode()),
                    (interop.AMQP_ROUTING_KEY, routing_key.encode()),
                ),
            )
            requests.append(AppendRequest(entry=copy, queues=tuple(dict.fromkeys(targets))))
        if requests:
            await host.processor.append(caller, requests, metered=False)
