"""One AMQP virtual host (a polymq namespace): its exchanges, queues and bindings.

Definitions are persisted as metadata through the processor (kinds
``amqp.exchange``, ``amqp.queue``, ``amqp.binding``) and cached here; routing is
computed from the cache. An AMQP queue is the storage topic ``amqp:<name>`` with one
storage queue per priority level (``x-max-priority``), consumed in pop mode by the one
group :data:`GROUP`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import hashlib
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from gateway.processor import Caller, Processor
from protocols.amqp import errors
from protocols.amqp.errors import ChannelError, ConnectionError_
from protocols.amqp.routing import DEFAULT_EXCHANGES, EXCHANGE_TYPES, Binding, Exchange, route
from storage.errors import StorageError, TopicAlreadyExists, TopicNotFound
from storage.model import UNLIMITED, GroupConfig, QueueRef, TopicConfig

__all__ = ["GROUP", "TOPIC_PREFIX", "QueueConsumer", "QueueDef", "VirtualHost", "json_safe"]

log = logging.getLogger(__name__)

GROUP: Final = "amqp"
TOPIC_PREFIX: Final = "amqp:"
MAX_PRIORITY: Final = 10  # storage queues per AMQP queue, at most (RabbitMQ allows 255)
_TRIM_EVERY_S: Final = 30.0
_EXCHANGE: Final = "amqp.exchange"
_QUEUE: Final = "amqp.queue"
_BINDING: Final = "amqp.binding"
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
)


def json_safe(value: Any) -> Any:
    """An AMQP field value as JSON (metadata is stored as JSON)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime):
        return int(value.timestamp())
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)


class QueueConsumer(Protocol):
    """What the vhost needs of a consumer: to tell it its queue went away, or that it
    may have become the single active one."""

    exclusive: bool
    serial: int  # order of arrival: the oldest is a single-active-consumer queue's active

    def queue_deleted(self) -> None: ...

    def wake(self) -> None: ...


@dataclass(kw_only=True, eq=False)
class QueueDef:
    name: str
    durable: bool = False
    exclusive_owner: str | None = None  # connection key of the declaring connection
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    consumers: set[QueueConsumer] = field(default_factory=set)
    ever_consumed: bool = False
    sweeping: asyncio.Lock = field(default_factory=asyncio.Lock)  # expiry passes
    last_used: float = 0.0

    @property
    def topic(self) -> str:
        return TOPIC_PREFIX + self.name

    @property
    def is_stream(self) -> bool:
        """A RabbitMQ stream: read by offset, acks do not remove messages."""
        return self.arguments.get("x-queue-type") == "stream"

    @property
    def single_active(self) -> bool:
        """``x-single-active-consumer``: one consumer at a time gets deliveries, the
        oldest; the next takes over when it goes (per gateway)."""
        return self.arguments.get("x-single-active-consumer") is True

    def active_consumer(self) -> QueueConsumer | None:
        return min(self.consumers, key=lambda c: c.serial, default=None)

    @property
    def max_priority(self) -> int:
        value = self.arguments.get("x-max-priority")
        return max(0, min(MAX_PRIORITY, value)) if isinstance(value, int) else 0

    def refs(self, namespace: str) -> tuple[QueueRef, ...]:
        """The storage queues, highest priority first."""
        return tuple(QueueRef(namespace, self.topic, p) for p in range(self.max_priority, -1, -1))

    def ref_for(self, namespace: str, priority: int | None) -> QueueRef:
        return QueueRef(namespace, self.topic, max(0, min(self.max_priority, priority or 0)))

    def int_argument(self, name: str) -> int | None:
        value = self.arguments.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def to_json(self) -> dict[str, Any]:
        return {
            "durable": self.durable,
            "exclusive": self.exclusive_owner is not None,
            "auto_delete": self.auto_delete,
            "arguments": self.arguments,
        }


def _binding_key(binding: Binding) -> str:
    return hashlib.sha1(binding.id.encode(), usedforsecurity=False).hexdigest()


class VirtualHost:
    """The cached definitions of one namespace, changed only through these methods
    (which persist first, then update the cache, under one lock)."""

    def __init__(self, namespace: str, processor: Processor) -> None:
        self.namespace = namespace
        self._processor = processor
        self._sweepers: dict[str, asyncio.Task[None]] = {}
        self._trimmer: asyncio.Task[None] | None = None
        self._trimmed: dict[QueueRef, int] = {}  # the prefix each queue was trimmed to
        self.exchanges: dict[str, Exchange] = {e.name: e for e in DEFAULT_EXCHANGES}
        self.queues: dict[str, QueueDef] = {}
        self._bindings: dict[str, Binding] = {}
        self._by_source: dict[str, list[Binding]] = {}
        self._route_cache: dict[tuple[str, str], frozenset[str]] = {}
        self._lock = asyncio.Lock()
        self._expiry_tasks: dict[str, asyncio.Task[None]] = {}
        # Direct reply-to (amq.rabbitmq.reply-to): token -> the consuming channel's sink.
        self.reply_to: dict[str, Callable[[str, bytes, bytes], None]] = {}

    async def trim_consumed(self, caller: Caller) -> None:
        """Let storage reclaim consumed messages: each queue's log is trimmed
        (``delete_records``) up to the group's fully acked prefix (``consumed_below``),
        so acked messages do not hold disk even in a queue that never drains. Only
        :data:`GROUP` reads a (non-stream) AMQP queue, so nothing below that prefix can
        be wanted again. Run every :data:`_TRIM_EVERY_S`, not per ack: one cheap look
        per storage queue, a deletion only when the prefix moved."""
        for queue in list(self.queues.values()):
            if queue.is_stream:
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

    async def close(self) -> None:
        if self._trimmer is not None:
            self._trimmer.cancel()
            await asyncio.gather(self._trimmer, return_exceptions=True)
        tasks = [*self._expiry_tasks.values(), *self._sweepers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- loading ---------------------------------------------------------------------

    async def load(self, caller: Caller) -> None:
        """Read the definitions back; drop what does not outlive a restart (transient
        or exclusive queues, transient exchanges)."""
        p = self._processor
        await p.set_group_config(
            caller, GROUP, GroupConfig(max_delivery_attempts=None, dead_letter=False)
        )
        for name, value in (await p.meta_list(caller, _EXCHANGE)).items():
            exchange = Exchange(
                name=name,
                type=value["type"],
                durable=value["durable"],
                auto_delete=value["auto_delete"],
                internal=value["internal"],
                arguments=value["arguments"],
            )
            if exchange.durable:
                self.exchanges[name] = exchange
            else:
                await p.meta_delete(caller, _EXCHANGE, name)
        for name, value in (await p.meta_list(caller, _QUEUE)).items():
            queue = QueueDef(
                name=name,
                durable=value["durable"],
                auto_delete=value["auto_delete"],
                arguments=value["arguments"],
            )
            if queue.durable and not value["exclusive"]:
                self.queues[name] = queue
                self._schedule_expiry(caller, queue)
                if queue.int_argument("x-message-ttl") is not None:
                    self._start_sweeper(caller, queue)
            else:
                await self._drop_queue_storage(caller, queue)
        self._trimmer = asyncio.create_task(self._trim_periodically(caller))
        for key, value in (await p.meta_list(caller, _BINDING)).items():
            binding = Binding(
                source=value["source"],
                destination=value["destination"],
                routing_key=value["routing_key"],
                to_exchange=value["to_exchange"],
                arguments=tuple((k, v) for k, v in value["arguments"]),
            )
            target = self.exchanges if binding.to_exchange else self.queues
            if binding.source in self.exchanges and binding.destination in target:
                self._add_binding(binding)
            else:
                await p.meta_delete(caller, _BINDING, key)

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
            await self._processor.meta_put(
                caller,
                _EXCHANGE,
                name,
                {
                    "type": type,
                    "durable": durable,
                    "auto_delete": auto_delete,
                    "internal": internal,
                    "arguments": exchange.arguments,
                },
            )
            self.exchanges[name] = exchange
            self._route_cache.clear()

    async def delete_exchange(self, caller: Caller, name: str, *, if_unused: bool) -> None:
        ids = (40, 20)
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

    async def _delete_exchange_locked(self, caller: Caller, name: str) -> None:
        for binding in list(self._bindings.values()):
            if binding.source == name or (binding.to_exchange and binding.destination == name):
                await self._remove_binding(caller, binding)
        await self._processor.meta_delete(caller, _EXCHANGE, name)
        self.exchanges.pop(name, None)
        self._route_cache.clear()

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
        async with self._lock:
            server_named = not name
            if server_named:
                name = "amq.gen-" + secrets.token_urlsafe(16)
            existing = self.queues.get(name)
            if passive or existing is not None:
                queue = self.queue(name, owner, *ids)
                if not passive:  # a redeclare counts as use (x-expires), a probe does not
                    self._check_equivalent(queue, durable, exclusive, auto_delete, arguments)
                    queue.last_used = asyncio.get_running_loop().time()
                return queue
            if name.startswith("amq.") and not server_named:
                raise ChannelError(
                    errors.ACCESS_REFUSED,
                    f"queue name '{name}' contains reserved prefix 'amq.*'",
                    *ids,
                )
            queue = QueueDef(
                name=name,
                durable=durable,
                exclusive_owner=owner if exclusive else None,
                auto_delete=auto_delete,
                arguments=json_safe(dict(arguments)),
            )
            self._validate_arguments(queue)
            config = TopicConfig(queue_count=queue.max_priority + 1, retention_ms=UNLIMITED)
            try:
                await self._processor.create_topic(caller, queue.topic, config)
            except TopicAlreadyExists:
                # Left over by a crash between creating the topic and its metadata.
                await self._processor.delete_topic(caller, queue.topic)
                await self._processor.create_topic(caller, queue.topic, config)
            await self._processor.meta_put(caller, _QUEUE, name, queue.to_json())
            self.queues[name] = queue
            queue.last_used = asyncio.get_running_loop().time()
            self._schedule_expiry(caller, queue)
            if queue.int_argument("x-message-ttl") is not None:
                self._start_sweeper(caller, queue)
            # Every queue is bound to the default exchange by its name: implicit in route.
            return queue

    def _validate_arguments(self, queue: QueueDef) -> None:
        if queue.is_stream and (
            not queue.durable or queue.exclusive_owner is not None or queue.auto_delete
        ):
            raise ChannelError(
                errors.PRECONDITION_FAILED,
                f"stream queue '{queue.name}' must be durable, not exclusive, not auto-delete",
                50,
                10,
            )
        for name in ("x-message-ttl", "x-expires", "x-max-length", "x-max-priority"):
            value = queue.arguments.get(name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ChannelError(
                    errors.PRECONDITION_FAILED,
                    f"invalid arg '{name}' for queue '{queue.name}': {value!r}",
                    50,
                    10,
                )
        if queue.arguments.get("x-expires") == 0:
            raise ChannelError(
                errors.PRECONDITION_FAILED, "invalid arg 'x-expires': must be positive", 50, 10
            )
        overflow = queue.arguments.get("x-overflow", "drop-head")
        if overflow not in ("drop-head", "reject-publish", "reject-publish-dlx"):
            raise ChannelError(
                errors.PRECONDITION_FAILED, f"invalid arg 'x-overflow': {overflow!r}", 50, 10
            )

    @staticmethod
    def _check_equivalent(
        queue: QueueDef,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
        arguments: Mapping[str, Any],
    ) -> None:
        if queue.durable != durable:
            raise ChannelError(
                errors.PRECONDITION_FAILED,
                f"inequivalent arg 'durable' for queue '{queue.name}': received"
                f" '{str(durable).lower()}' but current is '{str(queue.durable).lower()}'",
                50,
                10,
            )
        for key in _QUEUE_EQUIVALENCE:
            given = json_safe(arguments.get(key))
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
        """Delete a queue; its consumers are cancelled (consumer_cancel_notify).
        Returns how many messages it held."""
        ids = (50, 40)
        async with self._lock:
            queue = self.queues.get(name)
            if queue is None:
                return 0  # RabbitMQ: deleting a missing queue is ok
            self.queue(name, owner, *ids)
            if if_unused and queue.consumers:
                raise ChannelError(errors.PRECONDITION_FAILED, f"queue '{name}' in use", *ids)
            count = await self.message_count(caller, queue)
            if if_empty and count:
                raise ChannelError(errors.PRECONDITION_FAILED, f"queue '{name}' not empty", *ids)
            await self._delete_queue_locked(caller, queue)
            return count

    async def _delete_queue_locked(self, caller: Caller, queue: QueueDef) -> None:
        if self.queues.get(queue.name) is not queue:
            return
        for binding in list(self._bindings.values()):
            if not binding.to_exchange and binding.destination == queue.name:
                await self._remove_binding(caller, binding)
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
        await self._drop_queue_storage(caller, queue)

    async def _drop_queue_storage(self, caller: Caller, queue: QueueDef) -> None:
        with contextlib.suppress(TopicNotFound):
            await self._processor.delete_topic(caller, queue.topic)
        await self._processor.meta_delete(caller, _QUEUE, queue.name)

    async def message_count(self, caller: Caller, queue: QueueDef) -> int:
        """Ready messages (not counting those delivered and unacked), as RabbitMQ."""
        total = 0
        for ref in queue.refs(self.namespace):
            try:
                pending = await self._processor.pending_count(caller, GROUP, ref)
                inflight = await self._processor.inflight_count(caller, GROUP, ref)
            except TopicNotFound:
                return 0
            total += max(0, pending - inflight)
        return total

    async def purge(self, caller: Caller, queue: QueueDef) -> int:
        """Remove the ready messages; delivered, unacked ones stay (as RabbitMQ)."""
        purged = 0
        refs = queue.refs(self.namespace)
        while True:
            popped = await self._processor.pop(
                caller, GROUP, refs, max_messages=500, invisible_ms=60_000
            )
            if not popped:
                return purged
            await self._processor.ack_many(caller, GROUP, [m.receipt or "" for m in popped])
            purged += len(popped)

    async def release_owner(self, caller: Caller, owner: str) -> None:
        """Delete the exclusive queues of a closed connection."""
        async with self._lock:
            for queue in list(self.queues.values()):
                if queue.exclusive_owner == owner:
                    await self._delete_queue_locked(caller, queue)

    async def consumer_removed(self, caller: Caller, queue: QueueDef) -> None:
        """After a consumer left: auto-delete queues go with their last consumer."""
        queue.last_used = asyncio.get_running_loop().time()
        if queue.single_active:
            for consumer in queue.consumers:  # the next in line may take over
                consumer.wake()
        if queue.auto_delete and queue.ever_consumed and not queue.consumers:
            async with self._lock:
                await self._delete_queue_locked(caller, queue)
        else:
            self._schedule_expiry(caller, queue)

    def _schedule_expiry(self, caller: Caller, queue: QueueDef) -> None:
        """``x-expires``: delete the queue once unused (no consumers, no get, no
        re-declare) for that long."""
        expires = queue.int_argument("x-expires")
        if not expires or queue.name in self._expiry_tasks:
            return

        async def expire() -> None:
            loop = asyncio.get_running_loop()
            try:
                while self.queues.get(queue.name) is queue:
                    idle = loop.time() - queue.last_used
                    if not queue.consumers and idle * 1000 >= expires:
                        async with self._lock:
                            self._expiry_tasks.pop(queue.name, None)
                            await self._delete_queue_locked(caller, queue)
                        return
                    await asyncio.sleep(max(0.01, expires / 1000 - idle))
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

    @property
    def processor(self) -> Processor:
        return self._processor

    # -- bindings --------------------------------------------------------------------

    async def bind(
        self, caller: Caller, binding: Binding, *, owner: str | None, unbind: bool = False
    ) -> None:
        ids = (50, 50) if not binding.to_exchange else (40, 30)
        if unbind:
            ids = (50, 50 if not binding.to_exchange else 40)
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
                return
            if binding.id in self._bindings:
                return
            await self._processor.meta_put(
                caller,
                _BINDING,
                _binding_key(binding),
                {
                    "source": binding.source,
                    "destination": binding.destination,
                    "routing_key": binding.routing_key,
                    "to_exchange": binding.to_exchange,
                    "arguments": [list(pair) for pair in binding.arguments],
                },
            )
            self._add_binding(binding)

    def _add_binding(self, binding: Binding) -> None:
        self._bindings[binding.id] = binding
        self._by_source.setdefault(binding.source, []).append(binding)
        self._route_cache.clear()

    async def _remove_binding(self, caller: Caller, binding: Binding) -> None:
        await self._processor.meta_delete(caller, _BINDING, _binding_key(binding))
        self._bindings.pop(binding.id, None)
        remaining = [b for b in self._by_source.get(binding.source, ()) if b.id != binding.id]
        if remaining:
            self._by_source[binding.source] = remaining
        else:
            self._by_source.pop(binding.source, None)
            source = self.exchanges.get(binding.source)
            if source is not None and source.auto_delete:
                await self._delete_exchange_locked(caller, source.name)
        self._route_cache.clear()

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


class VirtualHosts:
    """The vhosts this gateway serves, loaded on first use."""

    async def close(self) -> None:
        """Stop the background work (expiry timers, TTL sweepers) of every vhost."""
        for host in self._hosts.values():
            await host.close()

    def __init__(self, processor: Processor) -> None:
        self._processor = processor
        self._hosts: dict[str, VirtualHost] = {}
        self._lock = asyncio.Lock()

    async def get(self, caller: Caller) -> VirtualHost:
        host = self._hosts.get(caller.namespace)
        if host is not None:
            return host
        async with self._lock:
            host = self._hosts.get(caller.namespace)
            if host is None:
                host = VirtualHost(caller.namespace, self._processor)
                await host.load(caller)
                self._hosts[caller.namespace] = host
            return host
