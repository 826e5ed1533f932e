"""The processor: the one interface protocol adapters call (RocketMQ's
``MessagingProcessor``).

Each call names its :class:`Caller`; the processor checks the caller may use the
namespace it acts in, counts the traffic for metering, and forwards to storage.
Namespaces come from the caller, never from arguments, so an adapter cannot act in a
tenant it did not authenticate for by passing a different name; ``QueueRef``\\s in
another namespace are refused for the same reason. Everything here speaks the
abstract model only: no protocol's types.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polymq.gateway.accounts import AccessDenied, Accounts, Principal
from polymq.gateway.authorizer import Authorizer
from polymq.gateway.latency import APPEND_BUCKETS_S, DELIVERY_BUCKETS_S, Histograms
from polymq.gateway.metering import Metering
from polymq.gateway.permissions import Operation, ResourceKind
from polymq.storage import api
from polymq.storage.clock import Clock
from polymq.storage.engine.stats import LogStats
from polymq.storage.model import (
    AppendRequest,
    AppendResult,
    BatchEntry,
    CommittedOffset,
    GroupConfig,
    HalfMessage,
    Message,
    QueueOffsets,
    QueueRef,
    ReadResult,
    StoredBatch,
    StoredMessage,
    TopicConfig,
    TopicInfo,
)

__all__ = ["Caller", "Processor"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """Who asks, in which namespace, over which protocol and connection. Built once
    per connection (or per request for HTTP) after authentication."""

    principal: Principal
    namespace: str
    protocol: str
    connection_id: int | None = None
    client_id: str | None = None


def _entry_size(entry: Message | BatchEntry) -> tuple[int, int]:
    if isinstance(entry, BatchEntry):
        return entry.size, len(entry.raw)
    return 1, len(entry.body)


def _messages_size(messages: Iterable[StoredMessage]) -> tuple[int, int]:
    count = nbytes = 0
    for m in messages:
        count += 1
        nbytes += len(m.message.body)
    return count, nbytes


class Processor:
    def __init__(
        self, storage: api.StorageAPI, accounts: Accounts, metering: Metering, clock: Clock
    ) -> None:
        self._storage = storage
        self._accounts = accounts
        self._metering = metering
        # Adapters take the time from here, so tests can inject a manual clock.
        self.clock = clock
        # Per-resource permissions (docs/permissions.md): adapters ask before acting.
        self.permissions = Authorizer(storage, clock, accounts.rules())
        # Per protocol, for /metrics (gateway/latency.py): appends until storage
        # acknowledged them; how long delivered messages had been stored.
        self.append_latency = Histograms(APPEND_BUCKETS_S)
        self.delivery_age = Histograms(DELIVERY_BUCKETS_S)

    def storage_log_stats(self) -> LogStats | None:
        """The embedded engine's commit-log figures (fsyncs, group commits) for
        /metrics; ``None`` when storage runs elsewhere, whose processes serve their
        own (docs/metrics.md)."""
        stats = getattr(self._storage, "log_stats", None)
        return stats if isinstance(stats, LogStats) else None

    # -- checks --------------------------------------------------------------------

    def _check(self, caller: Caller) -> str:
        self._accounts.authorize(caller.principal, caller.namespace)
        return caller.namespace

    def _check_queues(self, caller: Caller, queues: Iterable[QueueRef]) -> str:
        namespace = self._check(caller)
        for queue in queues:
            if queue.namespace != namespace:
                raise AccessDenied(
                    f"queue {queue} is outside namespace {namespace!r} of this connection"
                )
        return namespace

    def _check_admin(self, caller: Caller, namespace: str) -> None:
        if not caller.principal.admin:
            raise AccessDenied(f"{caller.principal.name!r} may not manage namespaces")
        self._accounts.authorize(caller.principal, namespace)

    async def authorize(
        self, caller: Caller, kind: ResourceKind, name: str, operation: Operation
    ) -> None:
        """Raise :class:`AccessDenied` unless the caller may do ``operation`` on resource
        ``name`` of ``kind`` in its namespace; adapters call it before acting and map
        the error to their protocol's own."""
        await self.permissions.check(caller.principal, caller.namespace, kind, name, operation)

    async def permitted(
        self, caller: Caller, kind: ResourceKind, name: str, operation: Operation
    ) -> bool:
        """:meth:`authorize` as a yes or no (to filter listings)."""
        return await self.permissions.allowed(
            caller.principal, caller.namespace, kind, name, operation
        )

    # -- namespaces ----------------------------------------------------------------

    async def create_namespace(self, caller: Caller, namespace: str) -> None:
        self._check_admin(caller, namespace)
        await self._storage.create_namespace(namespace)

    async def delete_namespace(self, caller: Caller, namespace: str) -> None:
        self._check_admin(caller, namespace)
        await self._storage.delete_namespace(namespace)

    async def list_namespaces(self, caller: Caller) -> list[str]:
        """Only those the caller may use."""
        names = await self._storage.list_namespaces()
        return [n for n in names if caller.principal.may_use(n)]

    # -- topics and queues ---------------------------------------------------------

    async def create_topic(
        self, caller: Caller, topic: str, config: TopicConfig = api.DEFAULT_TOPIC_CONFIG
    ) -> TopicInfo:
        return await self._storage.create_topic(self._check(caller), topic, config)

    async def alter_topic(self, caller: Caller, topic: str, config: TopicConfig) -> TopicInfo:
        return await self._storage.alter_topic(self._check(caller), topic, config)

    async def delete_topic(self, caller: Caller, topic: str) -> None:
        await self._storage.delete_topic(self._check(caller), topic)

    async def list_topics(
        self, caller: Caller, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        """``include_internal``: also protocols' own topics (``TopicConfig.internal``),
        for the adapter that keeps them."""
        return await self._storage.list_topics(
            self._check(caller), include_internal=include_internal
        )

    async def describe_topic(self, caller: Caller, topic: str) -> TopicInfo:
        return await self._storage.describe_topic(self._check(caller), topic)

    async def queue_offsets(self, caller: Caller, queue: QueueRef) -> QueueOffsets:
        self._check_queues(caller, (queue,))
        return await self._storage.queue_offsets(queue)

    async def delete_records(
        self, caller: Caller, queue: QueueRef, before_offset: int
    ) -> QueueOffsets:
        self._check_queues(caller, (queue,))
        return await self._storage.delete_records(queue, before_offset)

    async def compact(
        self,
        caller: Caller,
        queue: QueueRef,
        drop: Sequence[int] = (),
        rewrite: Mapping[int, BatchEntry] | None = None,
    ) -> int:
        self._check_queues(caller, (queue,))
        return await self._storage.compact(queue, drop, rewrite)

    async def offset_for_timestamp(self, caller: Caller, queue: QueueRef, timestamp_ms: int) -> int:
        self._check_queues(caller, (queue,))
        return await self._storage.offset_for_timestamp(queue, timestamp_ms)

    # -- append --------------------------------------------------------------------

    async def append(
        self, caller: Caller, requests: Sequence[AppendRequest], *, metered: bool = True
    ) -> list[AppendResult]:
        """Produce. Counted once per request however many queues it dispatches to:
        metering bills what the producer sent. A request stored earlier under its dedup
        key (``duplicate`` result: a producer's retry) is not new traffic and is not
        counted; ``metered=False`` for copies an adapter makes of messages already
        counted (MQTT routing another protocol's records into its session queues)."""
        namespace = self._check_queues(caller, (q for r in requests for q in r.queues))
        started = time.perf_counter()
        results = await self._storage.append(requests)
        self.append_latency.observe(caller.protocol, time.perf_counter() - started)
        if metered:
            self._meter_appends(caller, namespace, requests, results)
        return results

    async def append_visible(
        self, caller: Caller, requests: Sequence[AppendRequest]
    ) -> tuple[list[AppendResult], Callable[[], Awaitable[None]] | None]:
        """:meth:`append`, answered once the entries are readable, with what to await
        for the fsync the durable ones asked for (None: nothing left): an adapter
        that must answer its requests in order (Kafka) handles the next one while
        the fsync runs. Storage that cannot say so (the separated form's clients)
        answers once durable."""
        visible = getattr(self._storage, "append_visible", None)
        if visible is None:
            return await self.append(caller, requests), None
        namespace = self._check_queues(caller, (q for r in requests for q in r.queues))
        started = time.perf_counter()
        results, durable = await visible(requests)
        self.append_latency.observe(caller.protocol, time.perf_counter() - started)
        self._meter_appends(caller, namespace, requests, results)
        return results, durable

    def _meter_appends(
        self,
        caller: Caller,
        namespace: str,
        requests: Sequence[AppendRequest],
        results: Sequence[AppendResult],
    ) -> None:
        messages = nbytes = 0
        for request, result in zip(requests, results, strict=True):
            if result.duplicate:
                continue
            count, size = _entry_size(request.entry)
            messages += count
            nbytes += size
        if messages:
            self._metering.record_in(namespace, caller.protocol, messages=messages, nbytes=nbytes)

    async def cancel_delayed(self, caller: Caller, message_id: str) -> bool:
        return await self._storage.cancel_delayed(self._check(caller), message_id)

    # -- reads (offset mode) -------------------------------------------------------

    async def read(
        self,
        caller: Caller,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = api.DEFAULT_READ_MAX_MESSAGES,
        max_bytes: int = api.DEFAULT_READ_MAX_BYTES,
        wait_ms: int = api.DEFAULT_WAIT_MS,
        metered: bool = True,
    ) -> ReadResult:
        """``metered=False`` for a look that delivers nothing (MNS PeekMessage, a
        browser): it is not billed as messages out."""
        namespace = self._check_queues(caller, (queue,))
        result = await self._storage.read(
            queue, offset, max_messages=max_messages, max_bytes=max_bytes, wait_ms=wait_ms
        )
        if metered:
            self._record_out(namespace, caller, result.messages)
        return result

    async def read_batches(
        self,
        caller: Caller,
        queue: QueueRef,
        offset: int,
        *,
        max_bytes: int = api.DEFAULT_READ_MAX_BYTES,
        wait_ms: int = api.DEFAULT_WAIT_MS,
        metered: bool = True,
    ) -> list[StoredBatch]:
        """``metered``: as for :meth:`read`."""
        namespace = self._check_queues(caller, (queue,))
        batches = await self._storage.read_batches(
            queue, offset, max_bytes=max_bytes, wait_ms=wait_ms
        )
        if not metered:
            return batches
        if batches:
            self._observe_age(caller, batches[0].store_timestamp_ms)
        messages = nbytes = 0
        for batch in batches:
            messages += batch.count
            nbytes += (
                len(batch.raw)
                if batch.raw is not None
                else sum(len(m.message.body) for m in batch.messages)
            )
        if messages:
            self._metering.record_out(namespace, caller.protocol, messages=messages, nbytes=nbytes)
        return batches

    async def commit_offset(
        self, caller: Caller, group: str, queue: QueueRef, offset: int, metadata: str = ""
    ) -> None:
        namespace = self._check_queues(caller, (queue,))
        await self._storage.commit_offset(namespace, group, queue, offset, metadata)

    async def fetch_offset(
        self, caller: Caller, group: str, queue: QueueRef
    ) -> CommittedOffset | None:
        namespace = self._check_queues(caller, (queue,))
        return await self._storage.fetch_offset(namespace, group, queue)

    async def list_group_offsets(
        self, caller: Caller, group: str
    ) -> dict[QueueRef, CommittedOffset]:
        return await self._storage.list_group_offsets(self._check(caller), group)

    async def delete_group_offsets(
        self, caller: Caller, group: str, queues: Sequence[QueueRef] | None = None
    ) -> None:
        namespace = self._check_queues(caller, queues or ())
        await self._storage.delete_group_offsets(namespace, group, queues)

    async def list_groups(self, caller: Caller) -> list[str]:
        return await self._storage.list_groups(self._check(caller))

    # -- pop mode ------------------------------------------------------------------

    async def set_group_config(self, caller: Caller, group: str, config: GroupConfig) -> None:
        await self._storage.set_group_config(self._check(caller), group, config)

    async def get_group_config(self, caller: Caller, group: str) -> GroupConfig:
        return await self._storage.get_group_config(self._check(caller), group)

    async def pop(
        self,
        caller: Caller,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int = api.DEFAULT_POP_MAX_MESSAGES,
        invisible_ms: int = api.DEFAULT_INVISIBLE_MS,
        wait_ms: int = api.DEFAULT_WAIT_MS,
        tags: frozenset[str] | None = None,
        durable: bool = True,
    ) -> list[StoredMessage]:
        """``durable`` and cancellation: see :meth:`storage.api.StorageAPI.pop`."""
        namespace = self._check_queues(caller, queues)
        messages = await self._storage.pop(
            namespace,
            group,
            queues,
            max_messages=max_messages,
            invisible_ms=invisible_ms,
            wait_ms=wait_ms,
            tags=tags,
            durable=durable,
        )
        self._record_out(namespace, caller, messages)
        return messages

    async def ack(self, caller: Caller, group: str, receipt: str, *, durable: bool = True) -> None:
        """``durable``: see :meth:`storage.api.StorageAPI.ack`."""
        await self._storage.ack(self._check(caller), group, receipt, durable=durable)

    async def ack_many(
        self, caller: Caller, group: str, receipts: Sequence[str], *, durable: bool = True
    ) -> list[str | None]:
        return await self._storage.ack_many(self._check(caller), group, receipts, durable=durable)

    async def nack(self, caller: Caller, group: str, receipt: str, *, delay_ms: int = 0) -> None:
        await self._storage.nack(self._check(caller), group, receipt, delay_ms=delay_ms)

    async def give_back(self, caller: Caller, group: str, receipts: Sequence[str]) -> None:
        """See :meth:`storage.api.StorageAPI.give_back`."""
        await self._storage.give_back(self._check(caller), group, receipts)

    async def dead_letter(self, caller: Caller, group: str, receipt: str) -> None:
        await self._storage.dead_letter(self._check(caller), group, receipt)

    async def change_invisibility(
        self, caller: Caller, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        return await self._storage.change_invisibility(
            self._check(caller), group, receipt, invisible_ms
        )

    async def inflight_count(self, caller: Caller, group: str, queue: QueueRef) -> int:
        namespace = self._check_queues(caller, (queue,))
        return await self._storage.inflight_count(namespace, group, queue)

    async def pending_count(self, caller: Caller, group: str, queue: QueueRef) -> int:
        namespace = self._check_queues(caller, (queue,))
        return await self._storage.pending_count(namespace, group, queue)

    async def consumed_below(self, caller: Caller, group: str, queue: QueueRef) -> int:
        namespace = self._check_queues(caller, (queue,))
        return await self._storage.consumed_below(namespace, group, queue)

    async def delayed_count(self, caller: Caller, queue: QueueRef) -> int:
        namespace = self._check_queues(caller, (queue,))
        return await self._storage.delayed_count(namespace, queue)

    # -- transactions --------------------------------------------------------------

    async def append_half(
        self, caller: Caller, request: AppendRequest, *, producer_group: str | None = None
    ) -> HalfMessage:
        """Counted as produced now, when its bytes arrive; the commit adds nothing."""
        namespace = self._check_queues(caller, request.queues)
        half = await self._storage.append_half(request, producer_group=producer_group)
        count, size = _entry_size(request.entry)
        self._metering.record_in(namespace, caller.protocol, messages=count, nbytes=size)
        return half

    async def end_transaction(
        self, caller: Caller, transaction_id: str, *, commit: bool
    ) -> AppendResult | None:
        return await self._storage.end_transaction(
            self._check(caller), transaction_id, commit=commit
        )

    async def list_undecided(self, caller: Caller, *, older_than_ms: int = 0) -> list[HalfMessage]:
        return await self._storage.list_undecided(self._check(caller), older_than_ms=older_than_ms)

    # -- keyed latest value --------------------------------------------------------

    async def put_latest(
        self, caller: Caller, topic: str, key: bytes, message: Message | None
    ) -> None:
        await self._storage.put_latest(self._check(caller), topic, key, message)

    async def get_latest(self, caller: Caller, topic: str, key: bytes) -> Message | None:
        return await self._storage.get_latest(self._check(caller), topic, key)

    async def list_latest(self, caller: Caller, topic: str) -> list[tuple[bytes, Message]]:
        return await self._storage.list_latest(self._check(caller), topic)

    # -- protocol metadata ---------------------------------------------------------

    async def meta_put(self, caller: Caller, kind: str, name: str, value: Any) -> None:
        await self._storage.meta_put(self._check(caller), kind, name, value)

    async def meta_get(self, caller: Caller, kind: str, name: str) -> Any | None:
        return await self._storage.meta_get(self._check(caller), kind, name)

    async def meta_delete(self, caller: Caller, kind: str, name: str) -> bool:
        return await self._storage.meta_delete(self._check(caller), kind, name)

    async def meta_list(self, caller: Caller, kind: str) -> dict[str, Any]:
        return await self._storage.meta_list(self._check(caller), kind)

    # -- helpers -------------------------------------------------------------------

    def _record_out(
        self, namespace: str, caller: Caller, messages: Iterable[StoredMessage]
    ) -> None:
        count, nbytes = _messages_size(messages)
        if count:
            self._metering.record_out(namespace, caller.protocol, messages=count, nbytes=nbytes)
            for first in messages:  # one sample per delivery: its oldest message
                self._observe_age(caller, first.store_timestamp_ms)
                break

    def _observe_age(self, caller: Caller, stored_ms: int) -> None:
        age_s = max(0, self.clock.now_ms() - stored_ms) / 1000
        self.delivery_age.observe(caller.protocol, age_s)
