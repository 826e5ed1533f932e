"""One AMQP virtual host (a polymq namespace): its exchanges, queues and bindings.

Definitions are persisted as metadata through the processor (kinds
``amqp.exchange``, ``amqp.queue``, ``amqp.binding``, and ``amqp.consumer`` for the
consumers of every gateway) and cached here; routing is computed from the cache.
Several gateways may serve one vhost: each change is also written to the vhost's
change log (:mod:`protocols.amqp.changes`), which every gateway tails to keep its
cache current, and a change returns once the live gateways have it. Queues are
described in :mod:`protocols.amqp.queues`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, Final

from gateway.processor import Caller, Processor
from protocols.amqp import errors
from protocols.amqp.changes import CHANGES_TOPIC, Change, ChangeLog, Membership
from protocols.amqp.errors import ChannelError, ConnectionError_
from protocols.amqp.queues import (
    GROUP,
    TOPIC_PREFIX,
    ConsumerEntry,
    QueueConsumer,
    QueueDef,
    json_safe,
)
from protocols.amqp.reply_to import ReplyRouter
from protocols.amqp.routing import DEFAULT_EXCHANGES, EXCHANGE_TYPES, Binding, Exchange, route
from storage.errors import InvalidName, StorageError, TopicAlreadyExists, TopicNotFound
from storage.model import UNLIMITED, GroupConfig, QueueRef, TopicConfig
from storage.names import check_name

__all__ = [
    "GROUP",
    "TOPIC_PREFIX",
    "QueueConsumer",
    "QueueDef",
    "VirtualHost",
    "VirtualHosts",
    "json_safe",
]

log = logging.getLogger(__name__)

_TRIM_EVERY_S: Final = 30.0
_REAP_EVERY_S: Final = 1.0
# A peer gateway missing from the directory this long is gone: its exclusive and
# transient queues and its consumers are removed (a restart under the same id at once).
_REAP_GRACE_S: Final = 3.0
_REACH_ATTEMPTS: Final = 100
_EXCHANGE: Final = "amqp.exchange"
_QUEUE: Final = "amqp.queue"
_BINDING: Final = "amqp.binding"
_CONSUMER: Final = "amqp.consumer"
_GROUP_CONFIG: Final = GroupConfig(max_delivery_attempts=None, dead_letter=False)
# Arguments compared on re-declare (RabbitMQ's "inequivalent arg" check).
_QUEUE_EQUIVALENCE: Final = (
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-queue-type",
    "x-single-active-consumer",
    "x-polymq-topic",
)


def _binding_key(binding: Binding) -> str:
    return hashlib.sha1(binding.id.encode(), usedforsecurity=False).hexdigest()


def _exchange_json(exchange: Exchange, home: str) -> dict[str, Any]:
    return {
        "type": exchange.type,
        "durable": exchange.durable,
        "auto_delete": exchange.auto_delete,
        "internal": exchange.internal,
        "arguments": dict(exchange.arguments),
        "home": home,
    }


def _exchange_from_json(name: str, value: Mapping[str, Any]) -> Exchange:
    return Exchange(
        name=name,
        type=value["type"],
        durable=value["durable"],
        auto_delete=value["auto_delete"],
        internal=value["internal"],
        arguments=value["arguments"],
    )


def _binding_json(binding: Binding) -> dict[str, Any]:
    return {
        "source": binding.source,
        "destination": binding.destination,
        "routing_key": binding.routing_key,
        "to_exchange": binding.to_exchange,
        "arguments": [list(pair) for pair in binding.arguments],
    }


def _binding_from_json(value: Mapping[str, Any]) -> Binding:
    return Binding(
        source=value["source"],
        destination=value["destination"],
        routing_key=value["routing_key"],
        to_exchange=value["to_exchange"],
        arguments=tuple((k, v) for k, v in value["arguments"]),
    )


class VirtualHost:
    """The cached definitions of one namespace, changed only through these methods
    (which persist first, then update the cache and the change log, under one lock)
    or by the change log's tail (other gateways' changes)."""

    def __init__(
        self, namespace: str, processor: Processor, membership: Membership | None = None
    ) -> None:
        self.namespace = namespace
        self._processor = processor
        self.membership = membership or Membership(_Alone(), "amqp", "local")
        self._changes: ChangeLog | None = None
        self._last_change = -1  # the offset of this gateway's latest change
        self._caller: Caller | None = None
        self._sweepers: dict[str, asyncio.Task[None]] = {}
        self._background: list[asyncio.Task[None]] = []
        self._spawned: set[asyncio.Task[None]] = set()
        self._trimmed: dict[QueueRef, int] = {}  # the prefix each queue was trimmed to
        self._absent_since: dict[str, float] = {}  # gateway id -> first seen missing
        self._tails: dict[str, str | None] = {}  # peer gateway id -> its tailing instance
        self.exchanges: dict[str, Exchange] = {e.name: e for e in DEFAULT_EXCHANGES}
        self._exchange_homes: dict[str, str] = {}  # transient exchanges' gateway instance
        self.queues: dict[str, QueueDef] = {}
        self._bindings: dict[str, Binding] = {}
        self._by_source: dict[str, list[Binding]] = {}
        self._route_cache: dict[tuple[str, str], frozenset[str]] = {}
        self._lock = asyncio.Lock()
        self._expiry_tasks: dict[str, asyncio.Task[None]] = {}
        # Direct reply-to (amq.rabbitmq.reply-to): the consuming channels' sinks.
        self.replies = ReplyRouter(processor, namespace, self.membership.gateway_id)

    @property
    def processor(self) -> Processor:
        return self._processor

    # -- background work -------------------------------------------------------------

    async def trim_consumed(self, caller: Caller) -> None:
        """Let storage reclaim consumed messages: each queue's log is trimmed
        (``delete_records``) up to the group's fully acked prefix (``consumed_below``),
        so acked messages do not hold disk even in a queue that never drains. Only
        :data:`GROUP` reads a (non-stream) AMQP queue, so nothing below that prefix can
        be wanted again. A view's topic belongs to others and is never trimmed. Run
        every :data:`_TRIM_EVERY_S` by the queue's owner gateway, not per ack: one
        cheap look per storage queue, a deletion only when the prefix moved."""
        for queue in list(self.queues.values()):
            if queue.is_stream or queue.view_topic is not None:
                continue
            if not self.membership.is_owner(queue.name):
                continue
            for ref in queue.refs(self.namespace):
                try:
                    below = await self._processor.consumed_below(caller, GROUP, ref)
                    if below > self._trimmed.get(ref, -1):
                        bounds = await self._processor.queue_offsets(caller, ref)
                        if below > bounds.earliest:
                            await self._processor.delete_records(caller, ref, below)
                        self._trimmed[ref] = below
                except StorageError as e:  # deleted meanwhile, or storage trouble
                    log.debug("amqp: trimming %s skipped: %s", ref, e)
                    self._trimmed.pop(ref, None)

    async def _trim_periodically(self, caller: Caller) -> None:
        while True:
            await asyncio.sleep(_TRIM_EVERY_S)
            await self.trim_consumed(caller)

    async def _reap_periodically(self, caller: Caller) -> None:
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            try:
                await self.reap(caller)
            except StorageError as e:
                log.debug("amqp: reaping skipped: %s", e)

    async def reap(self, caller: Caller) -> None:
        """Remove what belonged to gateways that are gone (RabbitMQ removes a dead
        node's exclusive and transient queues): their exclusive and transient
        queues and exchanges, and their consumers. One gateway per queue does it.
        Gone: out of the directory for a while, or not (or under another instance)
        tailing this vhost's change log, which every gateway with a connection in it
        does (a gateway restarted at once under its id is never out of the directory)."""
        await self._look_at_tails()
        for queue in list(self.queues.values()):
            if not self.membership.is_owner(queue.name):
                continue
            if queue.home and self._gone(queue.home):
                async with self._lock:
                    await self._delete_queue_locked(caller, queue)
                continue
            for consumer_id, entry in list(queue.registry.items()):
                if self._gone(entry.instance):
                    await self._unregister(caller, queue, consumer_id)
        for name, home in list(self._exchange_homes.items()):
            if home and self._gone(home) and self.membership.is_owner(name):
                async with self._lock:
                    if name in self.exchanges:
                        await self._delete_exchange_locked(caller, name)

    async def _look_at_tails(self) -> None:
        """Which instance of each peer with consumers or queues here tails the vhost."""
        if self._changes is None:
            return
        instances = {q.home for q in self.queues.values() if q.home}
        instances |= {e.instance for q in self.queues.values() for e in q.registry.values()}
        peers = {i.partition("#")[0] for i in instances} - {self.membership.gateway_id}
        tails: dict[str, str | None] = {}
        for gateway_id in peers:
            tails[gateway_id] = await self._changes.tailing_instance(gateway_id)
        self._tails = tails

    def _gone(self, instance: str) -> bool:
        """Whether the gateway instance has ended: at once for this gateway's earlier
        runs, for a peer after :data:`_REAP_GRACE_S` out of the directory or not
        tailing the vhost as that instance."""
        membership = self.membership
        gateway_id = instance.partition("#")[0]
        if gateway_id == membership.gateway_id:
            return instance != membership.instance
        if gateway_id in self._tails:
            if self._tails[gateway_id] != instance:
                return self._absent_for(gateway_id + "\0tail")
            self._absent_since.pop(gateway_id + "\0tail", None)
        if membership.is_live(instance):
            self._absent_since.pop(gateway_id, None)
            return False
        return self._absent_for(gateway_id)

    def _absent_for(self, key: str) -> bool:
        now = asyncio.get_running_loop().time()
        since = self._absent_since.setdefault(key, now)
        return now - since >= _REAP_GRACE_S

    async def close(self) -> None:
        await self.replies.close()
        if self._changes is not None:
            await self._changes.close()
        tasks = [
            *self._background,
            *self._expiry_tasks.values(),
            *self._sweepers.values(),
            *self._spawned,
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    # -- loading ---------------------------------------------------------------------

    async def load(self, caller: Caller) -> None:
        """Read the definitions back, then follow the change log from where it ended
        before reading them; drop what does not outlive its gateway (transient or
        exclusive queues, transient exchanges, consumers of an earlier run)."""
        p = self._processor
        self._caller = caller
        changes = ChangeLog(p, caller, self.membership, self._apply)
        start = await changes.open()
        self._changes = changes  # what is dropped here is announced (gateways running on)
        await p.set_group_config(caller, GROUP, _GROUP_CONFIG)
        for name, value in (await p.meta_list(caller, _EXCHANGE)).items():
            home = str(value.get("home") or "")
            if value["durable"] or (home and not self._gone(home)):
                self.exchanges[name] = _exchange_from_json(name, value)
                if not value["durable"]:
                    self._exchange_homes[name] = home
            else:
                await p.meta_delete(caller, _EXCHANGE, name)
                await self._emit(caller, "exchange", name, None)
        for name, value in (await p.meta_list(caller, _QUEUE)).items():
            queue = QueueDef.from_json(name, value)
            lasting = queue.durable and queue.exclusive_owner is None
            if lasting or (queue.home and not self._gone(queue.home)):
                self._add_queue(caller, queue)
                if queue.view_topic is not None:
                    await p.set_group_config(caller, queue.group, _GROUP_CONFIG)
                    await self.resolve_view(caller, queue)
            else:
                await self._drop_queue_storage(caller, queue)
                await self._emit(caller, "queue", name, None)
        for key, value in (await p.meta_list(caller, _BINDING)).items():
            binding = _binding_from_json(value)
            target = self.exchanges if binding.to_exchange else self.queues
            if binding.source in self.exchanges and binding.destination in target:
                self._add_binding(binding)
            else:
                await p.meta_delete(caller, _BINDING, key)
                await self._emit(caller, "binding", binding.id, None)
        for consumer_id, value in (await p.meta_list(caller, _CONSUMER)).items():
            found = self.queues.get(str(value.get("queue")))
            instance = str(value.get("instance", ""))
            if found is None or self._gone(instance):
                await p.meta_delete(caller, _CONSUMER, consumer_id)
                gone = {"queue": str(value.get("queue")), "gone": True}
                await self._emit(caller, "consumer", consumer_id, gone)
                continue
            found.registry[consumer_id] = ConsumerEntry(
                serial=int(value["serial"]), exclusive=bool(value["exclusive"]), instance=instance
            )
            found.ever_consumed = True
        await changes.start(start)
        await self.replies.open(caller)
        self._background = [
            asyncio.create_task(self._trim_periodically(caller)),
            asyncio.create_task(self._reap_periodically(caller)),
        ]

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

    async def _settle(self, before: int) -> None:
        """After a change made since ``before``: wait until the live peers have it."""
        if self._changes is not None and self._last_change > before:
            await self._changes.barrier(self._last_change)

    async def _apply(self, change: Change, offset: int) -> None:
        """Another gateway's change, in log order (it made the storage calls; a new
        queue's topic is only looked up, until this gateway's storage client finds
        it)."""
        value = change.value
        if change.kind == "exchange":
            self._route_cache.clear()
            if value is None:
                self.exchanges.pop(change.name, None)
                self._exchange_homes.pop(change.name, None)
                for binding in list(self._bindings.values()):  # announced too; to be sure
                    name = change.name
                    if binding.source == name or (
                        binding.to_exchange and binding.destination == name
                    ):
                        self._forget_binding(binding.id)
            else:
                self.exchanges[change.name] = _exchange_from_json(change.name, value)
                if not value["durable"]:
                    self._exchange_homes[change.name] = str(value.get("home") or "")
        elif change.kind == "binding":
            if value is None:
                self._forget_binding(change.name)
            elif change.name not in self._bindings:
                self._add_binding(_binding_from_json(value))
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
                self._spawn(self._delete_if_unused(queue))
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
            value = _exchange_json(exchange, home)
            await self._processor.meta_put(caller, _EXCHANGE, name, value)
            self.exchanges[name] = exchange
            if home:
                self._exchange_homes[name] = home
            self._route_cache.clear()
            await self._emit(caller, "exchange", name, value)
        await self._settle(before)

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
            if if_unused and self._by_source.get(name):
                raise ChannelError(errors.PRECONDITION_FAILED, f"exchange '{name}' in use", *ids)
            await self._delete_exchange_locked(caller, name)
        await self._settle(before)

    async def _delete_exchange_locked(self, caller: Caller, name: str) -> None:
        for binding in list(self._bindings.values()):
            if binding.source == name or (binding.to_exchange and binding.destination == name):
                await self._remove_binding(caller, binding)
        await self._processor.meta_delete(caller, _EXCHANGE, name)
        self.exchanges.pop(name, None)
        self._exchange_homes.pop(name, None)
        self._route_cache.clear()
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
            self._validate_arguments(queue)
            if queue.view_topic is not None:
                await self._processor.set_group_config(caller, queue.group, _GROUP_CONFIG)
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
            await self._processor.meta_put(caller, _QUEUE, name, queue.to_json())
            self._add_queue(caller, queue)
            await self._emit(caller, "queue", name, queue.to_json())
            # Every queue is bound to the default exchange by its name: implicit in route.
        await self._settle(before)
        return queue

    def _redeclare(self, caller: Caller, wanted: QueueDef, owner: str, passive: bool) -> QueueDef:
        """A declare of a queue that exists: ``wanted`` must be equivalent to it."""
        queue = self.queue(wanted.name, owner, 50, 10)
        if not passive:  # a redeclare counts as use (x-expires), a probe does not
            self._check_equivalent(queue, wanted)
            self.touch(caller, queue)
        return queue

    async def _adopt(self, caller: Caller, name: str) -> QueueDef | None:
        """The definition another gateway stored for ``name``, now in the cache."""
        value = await self._processor.meta_get(caller, _QUEUE, name)
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
        self._route_cache.clear()
        self._schedule_expiry(caller, queue)
        if queue.int_argument("x-message-ttl") is not None:
            self._start_sweeper(caller, queue)

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

    def _validate_arguments(self, queue: QueueDef) -> None:
        def refuse(text: str) -> ChannelError:
            return ChannelError(errors.PRECONDITION_FAILED, text, 50, 10)

        if queue.is_stream and (
            not queue.durable or queue.exclusive_owner is not None or queue.auto_delete
        ):
            raise refuse(
                f"stream queue '{queue.name}' must be durable, not exclusive, not auto-delete"
            )
        for name in ("x-message-ttl", "x-expires", "x-max-length", "x-max-priority"):
            value = queue.arguments.get(name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise refuse(f"invalid arg '{name}' for queue '{queue.name}': {value!r}")
        if queue.arguments.get("x-expires") == 0:
            raise refuse("invalid arg 'x-expires': must be positive")
        overflow = queue.arguments.get("x-overflow", "drop-head")
        if overflow not in ("drop-head", "reject-publish", "reject-publish-dlx"):
            raise refuse(f"invalid arg 'x-overflow': {overflow!r}")
        self._validate_view(queue)

    @staticmethod
    def _validate_view(queue: QueueDef) -> None:
        """``x-polymq-topic``: a storage topic's name, not an AMQP queue's own topic or
        polymq's bookkeeping; not combined with streams or priorities."""
        key = "x-polymq-topic"
        if key not in queue.arguments:
            return
        topic = queue.arguments[key]
        try:
            check_name("topic", topic)
        except InvalidName as e:
            raise ChannelError(
                errors.PRECONDITION_FAILED, f"invalid arg '{key}': {e}", 50, 10
            ) from e
        if topic.startswith((TOPIC_PREFIX, "%")) or topic == CHANGES_TOPIC:
            raise ChannelError(
                errors.PRECONDITION_FAILED,
                f"invalid arg '{key}': {topic!r} is not a storage topic a view may read",
                50,
                10,
            )
        for other in ("x-queue-type", "x-max-priority"):
            if other in queue.arguments and not (
                other == "x-queue-type" and queue.arguments[other] in ("classic", "quorum")
            ):
                raise ChannelError(
                    errors.PRECONDITION_FAILED,
                    f"'{key}' cannot be combined with '{other}' (queue '{queue.name}')",
                    50,
                    10,
                )

    @staticmethod
    def _check_equivalent(queue: QueueDef, wanted: QueueDef) -> None:
        durable = wanted.durable
        if queue.durable != durable:
            raise ChannelError(
                errors.PRECONDITION_FAILED,
                f"inequivalent arg 'durable' for queue '{queue.name}': received"
                f" '{str(durable).lower()}' but current is '{str(queue.durable).lower()}'",
                50,
                10,
            )
        for key in _QUEUE_EQUIVALENCE:
            given = wanted.arguments.get(key)
            if given != queue.arguments.get(key):
                raise ChannelError(
                    errors.PRECONDITION_FAILED,
                    f"inequivalent arg '{key}' for queue '{queue.name}': received {given!r}"
                    f" but current is {queue.arguments.get(key)!r}",
                    50,
                    10,
                )

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
            await self._delete_queue_locked(caller, queue)
        await self._settle(before)
        return count

    async def _delete_queue_locked(self, caller: Caller, queue: QueueDef) -> None:
        if self.queues.get(queue.name) is not queue:
            return
        for binding in list(self._bindings.values()):
            if not binding.to_exchange and binding.destination == queue.name:
                await self._remove_binding(caller, binding)
        self._forget_queue(queue)
        await self._drop_queue_storage(caller, queue)
        await self._emit(caller, "queue", queue.name, None)

    def _forget_queue(self, queue: QueueDef) -> None:
        """Take a deleted queue out of this gateway: cache, timers, consumers."""
        if self.queues.get(queue.name) is not queue:
            return
        for binding in list(self._bindings.values()):
            if not binding.to_exchange and binding.destination == queue.name:
                self._forget_binding(binding.id)
        del self.queues[queue.name]
        for ref in queue.refs(self.namespace):
            self._trimmed.pop(ref, None)  # a queue declared again starts at offset 0
        self._route_cache.clear()
        for tasks in (self._expiry_tasks, self._sweepers):
            task = tasks.pop(queue.name, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        for consumer in list(queue.consumers):
            consumer.queue_deleted()
        queue.consumers.clear()

    async def _drop_queue_storage(self, caller: Caller, queue: QueueDef) -> None:
        if queue.view_topic is None:  # a view's topic is its producers', never deleted
            with contextlib.suppress(TopicNotFound):
                await self._processor.delete_topic(caller, queue.topic)
        for consumer_id in list(queue.registry):
            await self._processor.meta_delete(caller, _CONSUMER, consumer_id)
        queue.registry.clear()
        await self._processor.meta_delete(caller, _QUEUE, queue.name)

    async def message_count(self, caller: Caller, queue: QueueDef) -> int:
        """Ready messages (not counting those delivered and unacked), as RabbitMQ."""
        if queue.view_topic is not None:
            await self.resolve_view(caller, queue)
        total = 0
        for ref in queue.refs(self.namespace):
            try:
                pending = await self._processor.pending_count(caller, queue.group, ref)
                inflight = await self._processor.inflight_count(caller, queue.group, ref)
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
            await self._processor.ack_many(caller, queue.group, [m.receipt or "" for m in popped])
            purged += len(popped)

    async def release_owner(self, caller: Caller, owner: str) -> None:
        """Delete the exclusive queues of a closed connection."""
        async with self._lock:
            for queue in list(self.queues.values()):
                if queue.exclusive_owner == owner:
                    await self._delete_queue_locked(caller, queue)

    # -- consumers -------------------------------------------------------------------

    async def consumer_added(
        self, caller: Caller, consumer: QueueConsumer, queue: QueueDef
    ) -> None:
        """Register a consumer of this gateway for every gateway to see (exclusive
        consumers, single-active-consumer's order, auto-delete, consumer counts)."""
        value = {"queue": queue.name, "exclusive": consumer.exclusive}
        value["instance"] = self.membership.instance
        before = self._last_change
        offset = await self._emit(caller, "consumer", consumer.id, value)
        queue.registry[consumer.id] = ConsumerEntry(
            serial=offset, exclusive=consumer.exclusive, instance=self.membership.instance
        )
        queue.ever_consumed = True
        await self._processor.meta_put(caller, _CONSUMER, consumer.id, {**value, "serial": offset})
        await self._settle(before)
        if queue.single_active:
            for local in queue.consumers:
                local.wake()

    async def consumer_removed(
        self, caller: Caller, consumer: QueueConsumer, queue: QueueDef
    ) -> None:
        """After a consumer left: auto-delete queues go with their last consumer (on
        any gateway), and a single-active-consumer queue's next in line takes over."""
        queue.last_used = asyncio.get_running_loop().time()
        if self.queues.get(queue.name) is not queue:
            return  # deleted: its registry went with it
        await self._unregister(caller, queue, consumer.id)
        if not self._unused_auto_delete(queue):
            self._schedule_expiry(caller, queue)

    async def _unregister(self, caller: Caller, queue: QueueDef, consumer_id: str) -> None:
        if queue.registry.pop(consumer_id, None) is not None:
            await self._processor.meta_delete(caller, _CONSUMER, consumer_id)
            await self._emit(caller, "consumer", consumer_id, {"queue": queue.name, "gone": True})
        if queue.single_active:
            for consumer in queue.consumers:  # the next in line may take over
                consumer.wake()
        await self._delete_if_unused(queue)

    def _unused_auto_delete(self, queue: QueueDef) -> bool:
        return (
            queue.auto_delete and queue.ever_consumed and not queue.consumers and not queue.registry
        )

    async def _delete_if_unused(self, queue: QueueDef) -> None:
        if not self._unused_auto_delete(queue) or self._caller is None:
            return
        before = self._last_change
        async with self._lock:
            await self._delete_queue_locked(self._caller, queue)
        await self._settle(before)

    def touch(self, caller: Caller, queue: QueueDef) -> None:
        """The queue was used (a get, a redeclare): its ``x-expires`` clock restarts,
        on every gateway (told at most every quarter of the expiry)."""
        now = asyncio.get_running_loop().time()
        queue.last_used = now
        expires = queue.int_argument("x-expires")
        if expires and now - queue.touched >= max(0.2, expires / 4000):
            queue.touched = now
            self._spawn(self._emit_used(caller, queue))

    async def _emit_used(self, caller: Caller, queue: QueueDef) -> None:
        with contextlib.suppress(StorageError):
            await self._emit(caller, "used", queue.name, {"uid": queue.uid})

    def _schedule_expiry(self, caller: Caller, queue: QueueDef) -> None:
        """``x-expires``: delete the queue once unused (no consumers on any gateway,
        no get, no re-declare) for that long; the queue's owner gateway does it."""
        expires = queue.int_argument("x-expires")
        if not expires or queue.name in self._expiry_tasks:
            return

        async def expire() -> None:
            loop = asyncio.get_running_loop()
            try:
                while self.queues.get(queue.name) is queue:
                    idle = loop.time() - queue.last_used
                    if (
                        queue.consumers
                        or queue.registry
                        or not self.membership.is_owner(queue.name)
                    ):
                        await asyncio.sleep(min(1.0, expires / 1000))
                        continue
                    if idle * 1000 >= expires:
                        before = self._last_change
                        async with self._lock:
                            self._expiry_tasks.pop(queue.name, None)
                            await self._delete_queue_locked(caller, queue)
                        await self._settle(before)
                        return
                    await asyncio.sleep(max(0.01, min(1.0, expires / 1000 - idle)))
            finally:
                if self._expiry_tasks.get(queue.name) is asyncio.current_task():
                    del self._expiry_tasks[queue.name]

        self._expiry_tasks[queue.name] = asyncio.create_task(expire())

    def _start_sweeper(self, caller: Caller, queue: QueueDef, first_look_ms: int = 0) -> None:
        """The expiry sweeper of a queue (protocols.amqp.expiry): for as long as the
        queue lives if it has ``x-message-ttl``, else while its head expires."""
        if queue.is_stream or queue.name in self._sweepers:
            return
        from protocols.amqp.expiry import sweep_expired  # expiry needs this module

        task = asyncio.create_task(sweep_expired(caller, self, queue, first_look_ms))
        self._sweepers[queue.name] = task
        task.add_done_callback(
            lambda t: (
                self._sweepers.pop(queue.name) if self._sweepers.get(queue.name) is t else None
            )
        )

    def watch_expiry(self, caller: Caller, queue: QueueDef, expires_in_ms: int) -> None:
        """A message with its own ``expiration`` is going to ``queue``: make sure a
        sweeper looks at the head about when it expires, as RabbitMQ expires messages
        at the head without consumers."""
        if queue.name in self.queues:
            self._start_sweeper(caller, queue, expires_in_ms)

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
                if binding.id in self._bindings:
                    await self._remove_binding(caller, binding)
            elif binding.id not in self._bindings:
                value = _binding_json(binding)
                await self._processor.meta_put(caller, _BINDING, _binding_key(binding), value)
                self._add_binding(binding)
                await self._emit(caller, "binding", binding.id, value)
        await self._settle(before)

    def _add_binding(self, binding: Binding) -> None:
        self._bindings[binding.id] = binding
        self._by_source.setdefault(binding.source, []).append(binding)
        self._route_cache.clear()

    def _forget_binding(self, binding_id: str) -> Binding | None:
        binding = self._bindings.pop(binding_id, None)
        if binding is None:
            return None
        remaining = [b for b in self._by_source.get(binding.source, ()) if b.id != binding_id]
        if remaining:
            self._by_source[binding.source] = remaining
        else:
            self._by_source.pop(binding.source, None)
        self._route_cache.clear()
        return binding

    async def _remove_binding(self, caller: Caller, binding: Binding) -> None:
        await self._processor.meta_delete(caller, _BINDING, _binding_key(binding))
        self._forget_binding(binding.id)
        await self._emit(caller, "binding", binding.id, None)
        if not self._by_source.get(binding.source):
            source = self.exchanges.get(binding.source)
            if source is not None and source.auto_delete:
                await self._delete_exchange_locked(caller, source.name)

    # -- routing ---------------------------------------------------------------------

    def route(
        self, exchange: Exchange, routing_key: str, headers: Mapping[str, Any] | None
    ) -> Iterable[str]:
        """Names of the existing queues a publish reaches."""
        if exchange.type == "headers":
            names: Iterable[str] = route(
                self.exchanges, self._by_source, exchange.name, routing_key, headers
            )
        else:
            key = (exchange.name, routing_key)
            cached = self._route_cache.get(key)
            if cached is None:
                cached = frozenset(
                    route(self.exchanges, self._by_source, exchange.name, routing_key, headers)
                )
                if len(self._route_cache) > 10_000:
                    self._route_cache.clear()
                self._route_cache[key] = cached
            names = cached
        return [n for n in names if n in self.queues]


class _Alone:
    """The directory of a vhost built without one: this gateway only."""

    self_id = "local"

    def endpoints(self, protocol: str) -> tuple[()]:
        return ()


class VirtualHosts:
    """The vhosts this gateway serves, loaded on first use."""

    def __init__(self, processor: Processor, membership: Membership | None = None) -> None:
        self._processor = processor
        self.membership = membership or Membership(_Alone(), "amqp", "local")
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
                host = VirtualHost(caller.namespace, self._processor, self.membership)
                await host.load(caller)
                self._hosts[caller.namespace] = host
            return host
