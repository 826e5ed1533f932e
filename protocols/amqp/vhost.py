"""One AMQP virtual host (a polymq namespace): its exchanges, queues and bindings.

Definitions are persisted as metadata through the processor (kinds
``amqp.exchange``, ``amqp.queue``, ``amqp.binding``, and ``amqp.consumer`` for the
consumers of every gateway) and cached (:mod:`protocols.amqp.definitions`); routing
is computed from the cache. Several gateways may serve one vhost: each change is
also written to the vhost's change log (:mod:`protocols.amqp.changes`), which every
gateway tails to keep its cache current, and a change returns once the live gateways
have it. The work no call does (trimming, reaping, expiry) is in
:mod:`protocols.amqp.chores`; queues are described in :mod:`protocols.amqp.queues`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Final

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.amqp import errors
from polymq.protocols.amqp.changes import Change, ChangeLog, Membership
from polymq.protocols.amqp.chores import Chores
from polymq.protocols.amqp.definitions import (
    BINDING,
    CONSUMER,
    EXCHANGE,
    GROUP_CONFIG,
    QUEUE,
    Definitions,
    binding_from_json,
    binding_json,
    binding_key,
    exchange_from_json,
    exchange_json,
)
from polymq.protocols.amqp.errors import ChannelError, ConnectionError_
from polymq.protocols.amqp.feeds import FEED_META, Feeds
from polymq.protocols.amqp.later import until_stored
from polymq.protocols.amqp.natural import NaturalTopics
from polymq.protocols.amqp.queue_arguments import check_equivalent, validate_arguments
from polymq.protocols.amqp.queues import (
    GROUP,
    TOPIC_PREFIX,
    ConsumerEntry,
    QueueConsumer,
    QueueDef,
    json_safe,
)
from polymq.protocols.amqp.reply_to import ReplyRouter
from polymq.protocols.amqp.requeued import Requeued
from polymq.protocols.amqp.routing import DEFAULT_EXCHANGES, EXCHANGE_TYPES, Binding, Exchange
from polymq.storage.errors import (
    StorageError,
    StorageUnavailable,
    TopicAlreadyExists,
    TopicNotFound,
)
from polymq.storage.model import UNLIMITED, TopicConfig

__all__ = [
    "GROUP",
    "TOPIC_PREFIX",
    "AmqpServices",
    "QueueConsumer",
    "QueueDef",
    "VirtualHost",
    "json_safe",
]

log = logging.getLogger(__name__)

_REACH_ATTEMPTS: Final = 100
_UNANNOUNCED: Final = sys.maxsize  # a consumer's serial until its registration is stored


class VirtualHost:
    """The cached definitions of one namespace, changed only through these methods
    (which persist first, then update the cache and the change log, under one lock)
    or by the change log's tail (other gateways' changes)."""

    def __init__(
        self,
        namespace: str,
        processor: Processor,
        membership: Membership | None = None,
        natural: NaturalTopics | None = None,
    ) -> None:
        self.namespace = namespace
        # Which exchanges are storage topics (docs/interop.md, natural names).
        self.natural = natural or NaturalTopics()
        self._processor = processor
        self.membership = membership or Membership(_Alone(), "amqp", "local")
        self._changes: ChangeLog | None = None
        self._last_change = -1  # the offset of this gateway's latest change
        self._caller: Caller | None = None
        self.definitions = Definitions()
        # The cache's own dicts (never replaced), read on every publish.
        self.exchanges: dict[str, Exchange] = self.definitions.exchanges
        self.queues: dict[str, QueueDef] = self.definitions.queues
        self._lock = asyncio.Lock()
        self._closed = False
        self._chores = Chores(self)
        self._feeds = Feeds(self)
        # Requeued messages: ready, though storage counts them in flight.
        self.requeued = Requeued()
        # Direct reply-to (amq.rabbitmq.reply-to): the consuming channels' sinks.
        self.replies = ReplyRouter(processor, namespace, self.membership.gateway_id)

    @property
    def processor(self) -> Processor:
        return self._processor

    # What the chores (protocols.amqp.chores) use of this vhost.

    @property
    def changes(self) -> ChangeLog | None:
        return self._changes

    @property
    def lock(self) -> asyncio.Lock:
        return self._lock

    @property
    def last_change(self) -> int:
        return self._last_change

    async def trim_consumed(self, caller: Caller) -> None:
        """Let storage reclaim consumed messages now (the chores do it periodically)."""
        await self._chores.trim_consumed(caller)

    async def reap(self, caller: Caller) -> None:
        """Remove what gone gateways left now (the chores do it periodically)."""
        await self._chores.reap(caller)

    async def close(self) -> None:
        self._closed = True
        await self.replies.close()
        if self._changes is not None:
            await self._changes.close()
        await self._feeds.close()
        await self._chores.close()

    # -- loading ---------------------------------------------------------------------

    async def load(self, caller: Caller) -> None:
        """Read the definitions back, then follow the change log from where it ended
        before reading them; drop what does not outlive its gateway (transient or
        exclusive queues, transient exchanges, consumers of an earlier run).

        The definitions need the namespace's home node. The change log and this
        gateway's reply inbox may sit on other nodes: while one of those is down the
        vhost serves without it, and takes it up once its node is back (the change
        log's end first, then the definitions read again, so no change falls in
        between)."""
        p = self._processor
        self._caller = caller
        changes = ChangeLog(p, caller, self.membership, self._apply)
        try:
            start: int | None = await changes.open()
        except StorageUnavailable as e:
            log.warning("amqp: vhost %s loads without its change log: %s", self.namespace, e)
            start = None
        self._changes = changes  # what is dropped here is announced (gateways running on)
        await p.set_group_config(caller, GROUP, GROUP_CONFIG)
        await self._read_definitions(caller)
        if start is None:
            self._chores.spawn(
                until_stored(
                    lambda: self._follow_again(caller, changes),
                    lambda: not self._closed,
                    f"the change log of vhost {self.namespace}",
                )
            )
        else:
            await changes.start(start)
        try:
            await self.replies.open(caller)
        except StorageUnavailable as e:
            log.warning("amqp: direct reply-to inbox of %s opens later: %s", self.namespace, e)
            self._chores.spawn(
                until_stored(
                    lambda: self.replies.open(caller),
                    lambda: not self._closed,
                    f"the reply inbox of vhost {self.namespace}",
                )
            )
        self._chores.start(caller)
        self._feeds.start(caller)

    async def _follow_again(self, caller: Caller, changes: ChangeLog) -> None:
        """The change log is reachable again: tail it from its end, after reading the
        definitions anew (what changed while it was out of reach)."""
        start = await changes.open()
        async with self._lock:  # no declare of this gateway in between
            await self._read_definitions(caller)
        await changes.start(start)

    async def _read_definitions(self, caller: Caller) -> None:
        """Bring the cache to the stored definitions (at load, or again after the
        change log was out of reach: what is cached already stays as it is)."""
        p, defs, gone = self._processor, self.definitions, self._chores.gone
        exchanges = await p.meta_list(caller, EXCHANGE)
        for name, value in exchanges.items():
            home = str(value.get("home") or "")
            if value["durable"] or (home and not gone(home)):
                self.exchanges[name] = exchange_from_json(name, value)
                if not value["durable"]:
                    defs.exchange_homes[name] = home
            else:
                await p.meta_delete(caller, EXCHANGE, name)
                await self._emit_dropped(caller, "exchange", name, None)
        defaults = {e.name for e in DEFAULT_EXCHANGES}
        for name in [n for n in self.exchanges if n not in exchanges and n not in defaults]:
            defs.forget_exchange(name)
        queues = await p.meta_list(caller, QUEUE)
        for name, value in queues.items():
            cached = self.queues.get(name)
            if cached is not None and cached.uid == value.get("uid"):
                continue
            queue = QueueDef.from_json(name, value)
            lasting = queue.durable and queue.exclusive_owner is None
            if lasting or (queue.home and not gone(queue.home)):
                if cached is not None:
                    self._forget_queue(cached)
                self._add_queue(caller, queue)
                if queue.view_topic is not None:
                    await p.set_group_config(caller, queue.group, GROUP_CONFIG)
                    await self.resolve_view(caller, queue)
            else:
                await self._drop_queue_storage(caller, queue)
                await self._emit_dropped(caller, "queue", name, None)
        for name in [n for n in self.queues if n not in queues]:
            self._forget_queue(self.queues[name])
        bindings = await p.meta_list(caller, BINDING)
        stored: set[str] = set()
        for key, value in bindings.items():
            binding = binding_from_json(value)
            target = self.exchanges if binding.to_exchange else self.queues
            if binding.source in self.exchanges and binding.destination in target:
                stored.add(binding.id)
                if binding.id not in defs.bindings:
                    defs.add_binding(binding)
            else:
                await p.meta_delete(caller, BINDING, key)
                await self._emit_dropped(caller, "binding", binding.id, None)
        for binding_id in [b for b in defs.bindings if b not in stored]:
            defs.forget_binding(binding_id)
        for consumer_id, value in (await p.meta_list(caller, CONSUMER)).items():
            found = self.queues.get(str(value.get("queue")))
            instance = str(value.get("instance", ""))
            if found is None or gone(instance):
                await p.meta_delete(caller, CONSUMER, consumer_id)
                gone_value = {"queue": str(value.get("queue")), "gone": True}
                await self._emit_dropped(caller, "consumer", consumer_id, gone_value)
                continue
            if consumer_id not in found.registry:
                found.registry[consumer_id] = ConsumerEntry(
                    serial=int(value["serial"]),
                    exclusive=bool(value["exclusive"]),
                    instance=instance,
                )
            found.ever_consumed = True
        defs.routes_changed()

    async def _emit_dropped(self, caller: Caller, kind: str, name: str, value: Any) -> None:
        """Announce what loading dropped; with the change log out of reach, the peers
        see it when they next read the definitions."""
        with contextlib.suppress(StorageUnavailable):
            await self._emit(caller, kind, name, value)

    # -- the change log --------------------------------------------------------------

    async def _emit(self, caller: Caller, kind: str, name: str, value: Any) -> int:
        """Tell the other gateways (the change is persisted and applied here)."""
        if self._changes is None:
            return -1
        try:
            offset = await self._changes.append(
                Change(kind=kind, name=name, value=value, origin=self.membership.instance)
            )
        except TopicNotFound:  # the log was deleted (a namespace wiped): make it again
            await self._changes.open()
            return await self._emit(caller, kind, name, value)
        self._last_change = max(self._last_change, offset)
        return offset

    async def settle(self, before: int) -> None:
        """After a change made since ``before``: wait until the live peers have it."""
        if self._changes is not None and self._last_change > before:
            await self._changes.barrier(self._last_change)

    async def _apply(self, change: Change, offset: int) -> None:
        """Another gateway's change, in log order (it made the storage calls; a new
        queue's topic is only looked up, until this gateway's storage client finds
        it)."""
        value = change.value
        if change.kind == "exchange":
            self.definitions.apply_exchange(change.name, value)
        elif change.kind == "binding":
            self.definitions.apply_binding(change.name, value)
        elif change.kind == "queue":
            existing = self.queues.get(change.name)
            if value is None:
                if existing is not None:
                    self._forget_queue(existing)
            elif existing is None or existing.uid != value.get("uid"):
                if existing is not None:
                    self._forget_queue(existing)
                assert self._caller is not None
                queue = QueueDef.from_json(change.name, value)
                self._add_queue(self._caller, queue)
                await self._reach(self._caller, queue)
        elif change.kind == "consumer" and value is not None:
            self._apply_consumer(change.name, value, offset)
        elif change.kind == "used" and value is not None:
            found = self.queues.get(change.name)
            if found is not None and found.uid == value.get("uid"):
                found.last_used = asyncio.get_running_loop().time()

    def _apply_consumer(self, consumer_id: str, value: Mapping[str, Any], offset: int) -> None:
        queue = self.queues.get(str(value.get("queue")))
        if queue is None:
            return
        if value.get("gone"):
            if queue.registry.pop(consumer_id, None) is None:
                return
            queue.last_used = asyncio.get_running_loop().time()
            if self._unused_auto_delete(queue) and self.membership.is_owner(queue.name):
                self._chores.spawn(self._delete_if_unused(queue))
        else:
            queue.registry[consumer_id] = ConsumerEntry(
                serial=offset,
                exclusive=bool(value.get("exclusive")),
                instance=str(value["instance"]),
            )
            queue.ever_consumed = True
        if queue.single_active:
            for consumer in queue.consumers:
                consumer.wake()

    # -- exchanges -------------------------------------------------------------------

    def exchange(self, name: str, class_id: int = 0, method_id: int = 0) -> Exchange:
        found = self.exchanges.get(name)
        if found is None:
            raise ChannelError(
                errors.NOT_FOUND, f"no exchange '{name}' in vhost", class_id, method_id
            )
        return found

    async def declare_exchange(
        self,
        caller: Caller,
        *,
        name: str,
        type: str,
        passive: bool,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: Mapping[str, Any],
    ) -> None:
        ids = (40, 10)
        before = self._last_change
        async with self._lock:
            existing = self.exchanges.get(name)
            if passive:
                self.exchange(name, *ids)
                return
            if existing is not None:
                if existing.type != type:
                    raise ChannelError(
                        errors.PRECONDITION_FAILED,
                        f"inequivalent arg 'type' for exchange '{name}': received '{type}'"
                        f" but current is '{existing.type}'",
                        *ids,
                    )
                return
            if name.startswith("amq.") or name == "":
                raise ChannelError(
                    errors.ACCESS_REFUSED,
                    f"exchange name '{name}' contains reserved prefix 'amq.*'",
                    *ids,
                )
            if type not in EXCHANGE_TYPES:
                raise ConnectionError_(
                    errors.COMMAND_INVALID, f"unknown exchange type '{type}'", *ids
                )
            exchange = Exchange(
                name=name,
                type=type,
                durable=durable,
                auto_delete=auto_delete,
                internal=internal,
                arguments=json_safe(dict(arguments)),
            )
            home = "" if durable else self.membership.instance
            value = exchange_json(exchange, home)
            await self._processor.meta_put(caller, EXCHANGE, name, value)
            self.exchanges[name] = exchange
            if home:
                self.definitions.exchange_homes[name] = home
            self.definitions.routes_changed()
            await self._emit(caller, "exchange", name, value)
        await self.settle(before)

    async def delete_exchange(self, caller: Caller, name: str, *, if_unused: bool) -> None:
        ids = (40, 20)
        before = self._last_change
        async with self._lock:
            if name not in self.exchanges:
                return  # RabbitMQ: deleting a missing exchange is ok
            if name == "" or name.startswith("amq."):
                raise ChannelError(
                    errors.ACCESS_REFUSED, f"cannot delete reserved exchange '{name}'", *ids
                )
            if if_unused and self.definitions.has_bindings_from(name):
                raise ChannelError(errors.PRECONDITION_FAILED, f"exchange '{name}' in use", *ids)
            await self.delete_exchange_locked(caller, name)
        await self.settle(before)

    async def delete_exchange_locked(self, caller: Caller, name: str) -> None:
        """Delete an exchange and its bindings (the caller holds :attr:`lock`)."""
        for binding in self.definitions.bindings_of_exchange(name):
            await self._remove_binding(caller, binding)
        await self._processor.meta_delete(caller, EXCHANGE, name)
        await self._processor.meta_delete(caller, FEED_META, name)  # one made again starts anew
        self.definitions.forget_exchange(name)
        await self._emit(caller, "exchange", name, None)

    # -- queues ----------------------------------------------------------------------

    def queue(
        self, name: str, owner: str | None, class_id: int = 0, method_id: int = 0
    ) -> QueueDef:
        found = self.queues.get(name)
        if found is None:
            raise ChannelError(errors.NOT_FOUND, f"no queue '{name}' in vhost", class_id, method_id)
        if found.exclusive_owner is not None and found.exclusive_owner != owner:
            raise ChannelError(
                errors.RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked queue '{name}'",
                class_id,
                method_id,
            )
        return found

    async def declare_queue(
        self,
        caller: Caller,
        *,
        name: str,
        owner: str,
        passive: bool,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
        arguments: Mapping[str, Any],
    ) -> QueueDef:
        ids = (50, 10)
        before = self._last_change
        async with self._lock:
            server_named = not name
            if server_named:
                name = "amq.gen-" + secrets.token_urlsafe(16)
            queue = QueueDef(
                name=name,
                durable=durable,
                exclusive_owner=owner if exclusive else None,
                auto_delete=auto_delete,
                arguments=json_safe(dict(arguments)),
                home=self.membership.instance if exclusive or not durable else "",
            )
            if passive or name in self.queues:
                return self._redeclare(caller, queue, owner, passive)
            if name.startswith("amq.") and not server_named:
                raise ChannelError(
                    errors.ACCESS_REFUSED,
                    f"queue name '{name}' contains reserved prefix 'amq.*'",
                    *ids,
                )
            validate_arguments(queue)
            if queue.view_topic is not None:
                await self._processor.set_group_config(caller, queue.group, GROUP_CONFIG)
                await self.resolve_view(caller, queue)
            else:
                config = TopicConfig(queue_count=queue.max_priority + 1, retention_ms=UNLIMITED)
                try:
                    await self._processor.create_topic(caller, queue.topic, config)
                except TopicAlreadyExists:
                    adopted = await self._adopt(caller, name)
                    if adopted is not None:  # declared through another gateway meanwhile
                        return self._redeclare(caller, queue, owner, False)
                    # Left over by a crash between creating the topic and its metadata.
                    await self._processor.delete_topic(caller, queue.topic)
                    await self._processor.create_topic(caller, queue.topic, config)
            await self._processor.meta_put(caller, QUEUE, name, queue.to_json())
            self._add_queue(caller, queue)
            await self._emit(caller, "queue", name, queue.to_json())
            # Every queue is bound to the default exchange by its name: implicit in route.
        await self.settle(before)
        return queue

    def _redeclare(self, caller: Caller, wanted: QueueDef, owner: str, passive: bool) -> QueueDef:
        """A declare of a queue that exists: ``wanted`` must be equivalent to it."""
        queue = self.queue(wanted.name, owner, 50, 10)
        if not passive:  # a redeclare counts as use (x-expires), a probe does not
            check_equivalent(queue, wanted)
            self.touch(caller, queue)
        return queue

    async def _adopt(self, caller: Caller, name: str) -> QueueDef | None:
        """The definition another gateway stored for ``name``, now in the cache."""
        value = await self._processor.meta_get(caller, QUEUE, name)
        if value is None:
            return None
        existing = self.queues.get(name)
        if existing is not None and existing.uid == value.get("uid"):
            return existing
        if existing is not None:
            self._forget_queue(existing)
        queue = QueueDef.from_json(name, value)
        self._add_queue(caller, queue)
        return queue

    def _add_queue(self, caller: Caller, queue: QueueDef) -> None:
        self.queues[queue.name] = queue
        queue.last_used = asyncio.get_running_loop().time()
        self.definitions.routes_changed()
        self._chores.queue_added(caller, queue)

    async def _reach(self, caller: Caller, queue: QueueDef) -> None:
        """Wait (briefly) until storage answers for a queue another gateway made."""
        if queue.view_topic is not None:
            await self.resolve_view(caller, queue)
            return
        for _ in range(_REACH_ATTEMPTS):
            try:
                await self._processor.describe_topic(caller, queue.topic)
                return
            except TopicNotFound:
                if self.queues.get(queue.name) is not queue:
                    return  # deleted again meanwhile
                await asyncio.sleep(0.02)

    async def resolve_view(self, caller: Caller, queue: QueueDef) -> int:
        """How many storage queues a view's topic has now (0: it does not exist)."""
        topic = queue.view_topic
        if topic is None:
            return 0
        try:
            info = await self._processor.describe_topic(caller, topic)
            queue.view_queues = len(info.queues)
        except TopicNotFound:
            queue.view_queues = 0
        return queue.view_queues

    async def delete_queue(
        self,
        caller: Caller,
        name: str,
        *,
        owner: str | None,
        if_unused: bool = False,
        if_empty: bool = False,
    ) -> int:
        """Delete a queue; its consumers are cancelled (consumer_cancel_notify), on
        every gateway. Returns how many messages it held."""
        ids = (50, 40)
        before = self._last_change
        async with self._lock:
            queue = self.queues.get(name)
            if queue is None:
                return 0  # RabbitMQ: deleting a missing queue is ok
            self.queue(name, owner, *ids)
            if if_unused and queue.consumer_count:
                raise ChannelError(errors.PRECONDITION_FAILED, f"queue '{name}' in use", *ids)
            count = await self.message_count(caller, queue)
            if if_empty and count:
                raise ChannelError(errors.PRECONDITION_FAILED, f"queue '{name}' not empty", *ids)
            await self.delete_queue_locked(caller, queue)
        await self.settle(before)
        return count

    async def delete_queue_locked(self, caller: Caller, queue: QueueDef) -> None:
        """Delete a queue, its bindings and its storage (the caller holds :attr:`lock`)."""
        if self.queues.get(queue.name) is not queue:
            return
        for binding in self.definitions.bindings_to_queue(queue.name):
            await self._remove_binding(caller, binding)
        self._forget_queue(queue)
        await self._drop_queue_storage(caller, queue)
        await self._emit(caller, "queue", queue.name, None)

    def _forget_queue(self, queue: QueueDef) -> None:
        """Take a deleted queue out of this gateway: cache, timers, consumers."""
        if self.queues.get(queue.name) is not queue:
            return
        for binding in self.definitions.bindings_to_queue(queue.name):
            self.definitions.forget_binding(binding.id)
        del self.queues[queue.name]
        self.definitions.routes_changed()
        self._chores.queue_forgotten(queue)
        self.requeued.forget(queue.refs(self.namespace))
        for consumer in list(queue.consumers):
            consumer.queue_deleted()
        queue.consumers.clear()

    async def _drop_queue_storage(self, caller: Caller, queue: QueueDef) -> None:
        if queue.view_topic is None:  # a view's topic is its producers', never deleted
            with contextlib.suppress(TopicNotFound):
                await self._processor.delete_topic(caller, queue.topic)
        for consumer_id in list(queue.registry):
            await self._processor.meta_delete(caller, CONSUMER, consumer_id)
        queue.registry.clear()
        await self._processor.meta_delete(caller, QUEUE, queue.name)

    async def message_count(self, caller: Caller, queue: QueueDef) -> int:
        """Ready messages (not counting those delivered and unacked, but counting
        those requeued), as RabbitMQ."""
        if queue.view_topic is not None:
            await self.resolve_view(caller, queue)
        p, group, total = self._processor, queue.group, 0
        for ref in queue.refs(self.namespace):
            try:
                pending = await p.pending_count(caller, group, ref)
                inflight = await p.inflight_count(caller, group, ref)
                if self.requeued.waiting(ref):
                    consumed = await p.consumed_below(caller, group, ref)
                    inflight -= self.requeued.ready(ref, consumed, inflight)
            except TopicNotFound:
                return 0
            total += max(0, pending - inflight)
        return total

    async def purge(self, caller: Caller, queue: QueueDef) -> int:
        """Remove the ready messages; delivered, unacked ones stay (as RabbitMQ). For a
        view: consumed for this queue only, the topic keeps them for its other readers."""
        if queue.view_topic is not None and not await self.resolve_view(caller, queue):
            return 0
        purged = 0
        refs = queue.refs(self.namespace)
        while True:
            popped = await self._processor.pop(
                caller, queue.group, refs, max_messages=500, invisible_ms=60_000
            )
            if not popped:
                return purged
            self.requeued.taken(popped)
            await self._processor.ack_many(caller, queue.group, [m.receipt or "" for m in popped])
            purged += len(popped)

    async def release_owner(self, caller: Caller, owner: str) -> None:
        """Delete the exclusive queues of a closed connection."""
        async with self._lock:
            for queue in list(self.queues.values()):
                if queue.exclusive_owner == owner:
                    await self.delete_queue_locked(caller, queue)

    # -- consumers -------------------------------------------------------------------

    async def consumer_added(
        self, caller: Caller, consumer: QueueConsumer, queue: QueueDef
    ) -> None:
        """Register a consumer of this gateway for every gateway to see (exclusive
        consumers, single-active-consumer's order, auto-delete, consumer counts).
        While the storage that takes the registration is unavailable, the consumer
        consumes here, last in a single-active-consumer line, and is announced once
        storage is back (:mod:`protocols.amqp.later`)."""
        value = {"queue": queue.name, "exclusive": consumer.exclusive}
        value["instance"] = self.membership.instance
        before = self._last_change
        queue.registry[consumer.id] = ConsumerEntry(
            serial=_UNANNOUNCED, exclusive=consumer.exclusive, instance=self.membership.instance
        )
        queue.ever_consumed = True
        try:
            await self._announce_consumer(caller, queue, consumer.id, value)
        except StorageUnavailable as e:
            log.warning("amqp: consumer %s announced later: %s", consumer.id, e)
            self._chores.spawn(
                until_stored(
                    lambda: self._announce_consumer(caller, queue, consumer.id, value),
                    lambda: consumer.id in queue.registry and self.queues.get(queue.name) is queue,
                    f"consumer {consumer.id}",
                )
            )
        else:
            await self.settle(before)
        if queue.single_active:
            for local in queue.consumers:
                local.wake()

    async def _announce_consumer(
        self, caller: Caller, queue: QueueDef, consumer_id: str, value: dict[str, Any]
    ) -> None:
        entry = queue.registry.get(consumer_id)
        if entry is None:
            return  # gone meanwhile
        if entry.serial == _UNANNOUNCED:
            offset = await self._emit(caller, "consumer", consumer_id, value)
            entry = dataclasses.replace(entry, serial=offset)
            if consumer_id in queue.registry:
                queue.registry[consumer_id] = entry
        await self._processor.meta_put(
            caller, CONSUMER, consumer_id, {**value, "serial": entry.serial}
        )

    async def consumer_removed(
        self, caller: Caller, consumer: QueueConsumer, queue: QueueDef
    ) -> None:
        """After a consumer left: auto-delete queues go with their last consumer (on
        any gateway), and a single-active-consumer queue's next in line takes over."""
        queue.last_used = asyncio.get_running_loop().time()
        if self.queues.get(queue.name) is not queue:
            return  # deleted: its registry went with it
        await self.unregister(caller, queue, consumer.id)
        if not self._unused_auto_delete(queue):
            self._chores.schedule_expiry(caller, queue)

    async def unregister(self, caller: Caller, queue: QueueDef, consumer_id: str) -> None:
        """A consumer (of any gateway) is gone: every gateway is told (once storage is
        back, if it is unavailable now), and an auto-delete queue it leaves unused
        goes."""
        if queue.registry.pop(consumer_id, None) is not None:
            try:
                await self._announce_gone(caller, queue, consumer_id)
            except StorageUnavailable as e:
                log.warning(
                    "amqp: consumer %s's end announced once storage is back: %s", consumer_id, e
                )
                self._chores.spawn(
                    until_stored(
                        lambda: self._announce_gone(caller, queue, consumer_id),
                        lambda: consumer_id not in queue.registry,
                        f"the end of consumer {consumer_id}",
                    )
                )
        if queue.single_active:
            for consumer in queue.consumers:  # the next in line may take over
                consumer.wake()
        try:
            await self._delete_if_unused(queue)
        except StorageUnavailable as e:
            log.warning("amqp: auto-delete queue %s not deleted: %s", queue.name, e)

    async def _announce_gone(self, caller: Caller, queue: QueueDef, consumer_id: str) -> None:
        await self._processor.meta_delete(caller, CONSUMER, consumer_id)
        await self._emit(caller, "consumer", consumer_id, {"queue": queue.name, "gone": True})

    def _unused_auto_delete(self, queue: QueueDef) -> bool:
        return (
            queue.auto_delete and queue.ever_consumed and not queue.consumers and not queue.registry
        )

    async def _delete_if_unused(self, queue: QueueDef) -> None:
        if not self._unused_auto_delete(queue) or self._caller is None:
            return
        before = self._last_change
        async with self._lock:
            await self.delete_queue_locked(self._caller, queue)
        await self.settle(before)

    def touch(self, caller: Caller, queue: QueueDef) -> None:
        """The queue was used (a get, a redeclare): its ``x-expires`` clock restarts,
        on every gateway (told at most every quarter of the expiry)."""
        now = asyncio.get_running_loop().time()
        queue.last_used = now
        expires = queue.int_argument("x-expires")
        if expires and now - queue.touched >= max(0.2, expires / 4000):
            queue.touched = now
            self._chores.spawn(self._emit_used(caller, queue))

    async def _emit_used(self, caller: Caller, queue: QueueDef) -> None:
        with contextlib.suppress(StorageError):
            await self._emit(caller, "used", queue.name, {"uid": queue.uid})

    def watch_expiry(self, caller: Caller, queue: QueueDef, expires_in_ms: int) -> None:
        """A message with its own ``expiration`` is going to ``queue``: make sure a
        sweeper looks at the head about when it expires, as RabbitMQ expires messages
        at the head without consumers."""
        self._chores.watch_expiry(caller, queue, expires_in_ms)

    # -- bindings --------------------------------------------------------------------

    async def bind(
        self, caller: Caller, binding: Binding, *, owner: str | None, unbind: bool = False
    ) -> None:
        ids = (50, 50) if not binding.to_exchange else (40, 30)
        if unbind:
            ids = (50, 50 if not binding.to_exchange else 40)
        before = self._last_change
        async with self._lock:
            self.exchange(binding.source, *ids)
            if binding.to_exchange:
                self.exchange(binding.destination, *ids)
            else:
                self.queue(binding.destination, owner, *ids)
            if binding.source == "":
                raise ChannelError(
                    errors.ACCESS_REFUSED, "operation not permitted on the default exchange", *ids
                )
            if unbind:
                if binding.id in self.definitions.bindings:
                    await self._remove_binding(caller, binding)
            elif binding.id not in self.definitions.bindings:
                value = binding_json(binding)
                await self._processor.meta_put(caller, BINDING, binding_key(binding), value)
                await self._feeds.bound(caller, binding)
                self.definitions.add_binding(binding)
                await self._emit(caller, "binding", binding.id, value)
        await self.settle(before)

    async def _remove_binding(self, caller: Caller, binding: Binding) -> None:
        await self._processor.meta_delete(caller, BINDING, binding_key(binding))
        self.definitions.forget_binding(binding.id)
        await self._emit(caller, "binding", binding.id, None)
        if not self.definitions.has_bindings_from(binding.source):
            source = self.exchanges.get(binding.source)
            if source is not None and source.auto_delete:
                await self.delete_exchange_locked(caller, source.name)

    # -- routing ---------------------------------------------------------------------

    def route(
        self, exchange: Exchange, routing_key: str, headers: Mapping[str, Any] | None
    ) -> Iterable[str]:
        """Names of the existing queues a publish reaches."""
        return self.definitions.route(exchange, routing_key, headers)


class _Alone:
    """The directory of a vhost built without one: this gateway only."""

    self_id = "local"

    def endpoints(self, protocol: str) -> tuple[()]:
        return ()


class AmqpServices:
    """What one AMQP listener's connections share: the vhosts this gateway serves,
    loaded on first use, and this gateway's place among the live ones."""

    def __init__(
        self,
        processor: Processor,
        membership: Membership | None = None,
        natural: NaturalTopics | None = None,
    ) -> None:
        self._processor = processor
        self.membership = membership or Membership(_Alone(), "amqp", "local")
        self._natural = natural or NaturalTopics()
        self._hosts: dict[str, VirtualHost] = {}
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        """Stop the background work (change log tails, expiry timers, TTL sweepers) of
        every vhost."""
        for host in self._hosts.values():
            await host.close()

    async def get(self, caller: Caller) -> VirtualHost:
        host = self._hosts.get(caller.namespace)
        if host is not None:
            return host
        async with self._lock:
            host = self._hosts.get(caller.namespace)
            if host is None:
                host = VirtualHost(
                    caller.namespace, self._processor, self.membership, self._natural
                )
                try:
                    await host.load(caller)
                except BaseException:
                    await host.close()  # what it started (tails, timers); the next get tries anew
                    raise
                self._hosts[caller.namespace] = host
            return host
