"""The storage API over a pool of storage nodes (the separated form, docs/cluster.md).

A gateway in Cluster mode builds a :class:`ClusterStorage` where the merged form
builds an :class:`~storage.engine.Engine`; nothing above the storage API knows which
it got. Each call goes to the node that owns what it names, found in a route cache
that nameservers keep filled:

* **Topics are placed whole**: all queues of a topic live on one node, so a pop over
  a topic's queues, a FIFO group's order, a transaction and a multi-queue append
  within one topic stay inside one engine, with that engine's guarantees.
* **Namespace-wide data** (metadata, keyed latest values, group configs) lives on the
  namespace's *home* node, claimed the first time the namespace is used.
* **Receipts** handed out are the node's receipt prefixed with ``<node_id>:``, so an
  ack goes straight back to the node that issued it.

Nothing here is lost by a restart: routes are fetched again, and everything durable
is on the nodes.

This class is the entry point and says, per call, which node(s) it goes to; the
parts with rules of their own live beside it: finding and refreshing routes
(:mod:`storage.cluster_router`, over the cache of :mod:`storage.cluster_routes`),
namespace homes and group configs (:mod:`storage.cluster_homes`), appends spread over
nodes (:mod:`storage.cluster_append`), pops and acks over nodes
(:mod:`storage.cluster_pop`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from polymq.storage import api
from polymq.storage.clock import Clock, SystemClock
from polymq.storage.cluster_append import SpreadAppends
from polymq.storage.cluster_homes import Homes
from polymq.storage.cluster_pop import Overflow, PopAsk, ack_spread, pop_spread, with_prefix
from polymq.storage.cluster_router import Router, answers
from polymq.storage.cluster_routes import Connect, Node, NodeClient, RouteCache, RouteSource
from polymq.storage.errors import (
    InvalidArgument,
    NamespaceAlreadyExists,
    NamespaceNotFound,
    QueueNotFound,
    StorageError,
    StorageUnavailable,
    TopicAlreadyExists,
    TopicNotFound,
    TransactionNotFound,
)
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
from polymq.storage.names import check_name

__all__ = ["ClusterStorage", "NodeClient", "RouteSource"]


class ClusterStorage:
    """:class:`storage.api.StorageAPI` over the storage nodes a nameserver lists.

    ``route_source`` answers routes and placements (a ``NameserverClient``);
    ``connect`` makes the client of one node (a ``RemoteStorage``); :meth:`close`
    closes both (the route source if it has a ``close``). Routes are refreshed every
    ``refresh_ms`` and at once on a miss; :meth:`start` waits up to
    ``start_timeout_s`` for a first live node and goes on without one (calls answer
    :class:`StorageUnavailable` until a node registers).

    Every guarantee of the storage API holds per node, hence for every call that
    stays on one node: all calls naming one topic, one queue or one receipt, and
    namespace-wide data. Where a pool differs from one engine:

    * A node that is down (gone from the routes, or refusing connections) makes the
      calls on its topics, its receipts and, for the namespaces it is home to, their
      namespace-wide data raise :class:`StorageUnavailable` (retryable), naming it;
      other nodes keep serving. Its return is seen by the next route refresh. Lists
      (``list_topics``, ``list_groups``, ...) answer from the nodes that answer; a
      pop over several nodes' queues serves from those that are up; "not found" for
      a transaction or a delayed message becomes "unavailable" while a node is down.
    * An append over queues of several nodes stores a copy on each node, all under
      one message id this client assigns (the result carries the first queue's
      node's time, and every placement; ``cancel_delayed`` with that id, asked of
      every node, recalls every copy). If one node fails, others may have stored their
      share (``StorageUnavailable`` says so; a retry with the dedup key does not
      store those twice).
    * A transactional half message must name queues of one node.
    * Group configs are set on every live node (pops run there); a node that was down
      or joined later gets the home node's config before the first pop this client
      sends it.
    * A group's dead-letter topic is created by the node whose pop dead-letters, so
      groups consuming topics of several nodes get one per node; routes name the one
      on the lowest node id (known gap: dead letters on other nodes are not read
      through the routes).
    * Node ids must not contain ``:`` (receipts are ``<node_id>:<node's receipt>``).
    """

    def __init__(
        self,
        route_source: RouteSource,
        connect: Connect,
        *,
        refresh_ms: int = 500,
        start_timeout_s: float = 30.0,
        clock: Clock | None = None,
    ) -> None:
        self._clock: Clock = clock or SystemClock()
        self._router = Router(
            route_source,
            connect,
            refresh_ms=refresh_ms,
            start_timeout_s=start_timeout_s,
            clock=self._clock,
        )
        self._routes = self._router.cache
        self._homes = Homes(self._router, self._clock)
        self._spread = SpreadAppends(self._router, self._clock)
        self._overflow = Overflow()
        self._rotation = 0
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Wait (bounded) until the nameservers list a live node, then keep routes
        fresh; never fails for want of a node."""
        await self._router.start()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._router.stop()
        await self._give_back_overflow()
        await self._router.close()

    async def _give_back_overflow(self) -> None:
        """Messages handed out but never returned to a caller: visible again now."""
        for namespace, group, messages in self._overflow.drain():
            for message in messages:
                if message.receipt is not None:
                    with contextlib.suppress(StorageError):
                        await self.nack(namespace, group, message.receipt)

    # -- routes ----------------------------------------------------------------------

    @property
    def routes(self) -> RouteCache:
        """The route cache (for status pages and tests; do not change it)."""
        return self._routes

    async def refresh(self) -> None:
        """Fetch routes now. Callers at the same time share one fetch, and one that
        started before this call is not trusted to show what made the caller ask."""
        await self._router.refresh()

    # -- namespaces ------------------------------------------------------------------

    async def create_namespace(self, namespace: str) -> None:
        """On every live node. A namespace exists where any node has it; nodes that
        lack it (down meanwhile, joined later) get it when first used there."""
        check_name("namespace", namespace)
        results = await self._router.each_live(lambda c: c.create_namespace(namespace))
        answers(results, absent=NamespaceAlreadyExists)
        if any(isinstance(r, NamespaceAlreadyExists) for _, r in results):
            raise NamespaceAlreadyExists(f"namespace {namespace!r} already exists")

    async def delete_namespace(self, namespace: str) -> None:
        """Only when no node, reachable or not, holds a topic of it."""
        self._router.none_down_in(namespace)
        listed = await self._router.each_live(
            lambda c: c.list_topics(namespace, include_internal=True)
        )
        for node, result in listed:
            if isinstance(result, StorageUnavailable):
                raise node.unreachable(result)
            if isinstance(result, list) and result:
                raise InvalidArgument(f"namespace {namespace!r} still has topics")
        results = await self._router.each_live(lambda c: c.delete_namespace(namespace))
        answers(results, absent=NamespaceNotFound)
        self._routes.remove_namespace(namespace)

    async def list_namespaces(self) -> list[str]:
        results = await self._router.each_live(lambda c: c.list_namespaces())
        return sorted({name for names in answers(results) for name in names})

    # -- topics and queues -----------------------------------------------------------

    async def create_topic(
        self, namespace: str, topic: str, config: TopicConfig = api.DEFAULT_TOPIC_CONFIG
    ) -> TopicInfo:
        """On the node a nameserver places it on (the least loaded), whole."""
        check_name("topic", topic)
        node = await self._router.known_node(
            await self._router.source.place_topic(namespace, topic)
        )
        try:
            info = await self._homes.with_namespace(
                node, namespace, lambda c: c.create_topic(namespace, topic, config)
            )
        except TopicAlreadyExists:
            # A concurrent creator won (the nameserver placed both on this node): the
            # topic is there all the same, and callers go on to use it.
            self._routes.add_topic(namespace, topic, node, self._clock.now_ms())
            raise
        self._routes.add_topic(namespace, topic, node, self._clock.now_ms())
        return info

    async def alter_topic(self, namespace: str, topic: str, config: TopicConfig) -> TopicInfo:
        return await self._router.on_topic(
            namespace, topic, lambda c: c.alter_topic(namespace, topic, config)
        )

    async def delete_topic(self, namespace: str, topic: str) -> None:
        await self._router.on_topic(namespace, topic, lambda c: c.delete_topic(namespace, topic))
        self._routes.remove_topic(namespace, topic)

    async def list_topics(
        self, namespace: str, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        results = await self._router.each_live(
            lambda c: c.list_topics(namespace, include_internal=include_internal)
        )
        found: dict[str, TopicInfo] = {}
        for node, result in results:
            if isinstance(result, list):
                for info in result:
                    # A topic two nodes hold (a conflict the nameserver logs): the routed one.
                    if info.name not in found or self._routes.node(namespace, info.name) is node:
                        found[info.name] = info
        answers(results, absent=NamespaceNotFound)
        return [found[name] for name in sorted(found)]

    async def describe_topic(self, namespace: str, topic: str) -> TopicInfo:
        return await self._router.on_topic(
            namespace, topic, lambda c: c.describe_topic(namespace, topic)
        )

    async def queue_offsets(self, queue: QueueRef) -> QueueOffsets:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.queue_offsets(queue)
        )

    async def delete_records(self, queue: QueueRef, before_offset: int) -> QueueOffsets:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.delete_records(queue, before_offset)
        )

    async def offset_for_timestamp(self, queue: QueueRef, timestamp_ms: int) -> int:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.offset_for_timestamp(queue, timestamp_ms)
        )

    async def compact(
        self,
        queue: QueueRef,
        drop: Sequence[int] = (),
        rewrite: Mapping[int, BatchEntry] | None = None,
    ) -> int:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.compact(queue, drop, rewrite)
        )

    # -- append ----------------------------------------------------------------------

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        node = self._router.one_node(requests)
        if node is None:
            return await self._spread.append(requests)
        try:
            return await self._router.send(node, lambda c: c.append(requests))
        except StorageError as exc:
            if not isinstance(exc, TopicNotFound | QueueNotFound):
                raise
            with contextlib.suppress(StorageUnavailable):
                await self._router.refresh()
            if self._router.one_node(requests) is node:
                raise
            return await self._spread.append(requests)

    async def cancel_delayed(self, namespace: str, message_id: str) -> bool:
        """Asked of every live node: one holds it, or several (a spread append)."""
        results = await self._router.each_live(lambda c: c.cancel_delayed(namespace, message_id))
        if any(r is True for _, r in results):
            return True
        answers(results)
        self._router.none_down()  # it may be on a node that is down
        return False

    # -- reads (offset mode) ---------------------------------------------------------

    async def read(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = api.DEFAULT_READ_MAX_MESSAGES,
        max_bytes: int = api.DEFAULT_READ_MAX_BYTES,
        wait_ms: int = api.DEFAULT_WAIT_MS,
    ) -> ReadResult:
        node = self._router.cached(queue.namespace, queue.topic) or await self._router.route(
            queue.namespace, queue.topic
        )
        try:
            return await node.client.read(
                queue, offset, max_messages=max_messages, max_bytes=max_bytes, wait_ms=wait_ms
            )
        except StorageError as exc:
            return await self._router.recover(
                exc,
                node,
                queue.namespace,
                queue.topic,
                lambda c: c.read(
                    queue, offset, max_messages=max_messages, max_bytes=max_bytes, wait_ms=wait_ms
                ),
            )

    async def read_batches(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_bytes: int = api.DEFAULT_READ_MAX_BYTES,
        wait_ms: int = api.DEFAULT_WAIT_MS,
    ) -> list[StoredBatch]:
        node = self._router.cached(queue.namespace, queue.topic) or await self._router.route(
            queue.namespace, queue.topic
        )
        try:
            return await node.client.read_batches(
                queue, offset, max_bytes=max_bytes, wait_ms=wait_ms
            )
        except StorageError as exc:
            return await self._router.recover(
                exc,
                node,
                queue.namespace,
                queue.topic,
                lambda c: c.read_batches(queue, offset, max_bytes=max_bytes, wait_ms=wait_ms),
            )

    async def commit_offset(
        self, namespace: str, group: str, queue: QueueRef, offset: int, metadata: str = ""
    ) -> None:
        node = self._router.cached(queue.namespace, queue.topic) or await self._router.route(
            queue.namespace, queue.topic
        )
        try:
            await node.client.commit_offset(namespace, group, queue, offset, metadata)
        except StorageError as exc:
            await self._router.recover(
                exc,
                node,
                queue.namespace,
                queue.topic,
                lambda c: c.commit_offset(namespace, group, queue, offset, metadata),
            )

    async def fetch_offset(
        self, namespace: str, group: str, queue: QueueRef
    ) -> CommittedOffset | None:
        node = self._router.cached(queue.namespace, queue.topic) or await self._router.route(
            queue.namespace, queue.topic
        )
        try:
            return await node.client.fetch_offset(namespace, group, queue)
        except StorageError as exc:
            return await self._router.recover(
                exc,
                node,
                queue.namespace,
                queue.topic,
                lambda c: c.fetch_offset(namespace, group, queue),
            )

    async def list_group_offsets(
        self, namespace: str, group: str
    ) -> dict[QueueRef, CommittedOffset]:
        results = await self._router.each_live(lambda c: c.list_group_offsets(namespace, group))
        merged: dict[QueueRef, CommittedOffset] = {}
        for offsets in answers(results):
            merged.update(offsets)
        return merged

    async def delete_group_offsets(
        self, namespace: str, group: str, queues: Sequence[QueueRef] | None = None
    ) -> None:
        if queues is None:
            self._router.none_down_in(namespace)  # its offsets there would outlive the delete
            results = await self._router.each_live(
                lambda c: c.delete_group_offsets(namespace, group)
            )
            for node, result in results:
                if isinstance(result, BaseException):
                    raise (
                        node.unreachable(result)
                        if isinstance(result, StorageUnavailable)
                        else result
                    )
            return
        split: dict[Node, list[QueueRef]] = {}
        for queue in queues:
            node = await self._router.locate(queue.namespace, queue.topic)
            split.setdefault(node, []).append(queue)
        for node, part in split.items():

            async def delete(client: NodeClient, part: list[QueueRef] = part) -> None:
                await client.delete_group_offsets(namespace, group, part)

            await self._router.send(node, delete)

    async def list_groups(self, namespace: str) -> list[str]:
        results = await self._router.each_live(lambda c: c.list_groups(namespace))
        return sorted({g for groups in answers(results) for g in groups})

    # -- pop mode (queue semantics) --------------------------------------------------

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None:
        """On the home node (the authority; it must succeed), then on every other live
        node, where pops run. A node that misses it gets it before its next pop."""
        check_name("group", group)
        await self._homes.set_group_config(namespace, group, config)

    async def get_group_config(self, namespace: str, group: str) -> GroupConfig:
        return await self._homes.call_if_home(
            namespace, lambda c: c.get_group_config(namespace, group), absent=GroupConfig()
        )

    async def pop(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int = api.DEFAULT_POP_MAX_MESSAGES,
        invisible_ms: int = api.DEFAULT_INVISIBLE_MS,
        wait_ms: int = api.DEFAULT_WAIT_MS,
        tags: frozenset[str] | None = None,
        durable: bool = True,
    ) -> list[StoredMessage]:
        if self._overflow:
            held = self._overflow.take(
                namespace, group, queues, tags, max_messages, self._clock.now_ms()
            )
            if held:
                return held
        ask = PopAsk(namespace, group, max_messages, invisible_ms, wait_ms, tags, durable)
        node = self._router.holder(queues)
        if node is None:
            return await self._pop_spread(ask, queues)
        synced = node.synced_groups.get(namespace)
        if synced is None or group not in synced:
            await self._homes.sync_group(node, namespace, group)
        popped = await self._router.send(node, lambda c: ask.send(c, queues))
        return with_prefix(popped, node.prefix)

    async def _pop_spread(self, ask: PopAsk, queues: Sequence[QueueRef]) -> list[StoredMessage]:
        api.check_pop(ask.group, queues, ask.max_messages, ask.invisible_ms)
        split: dict[Node, list[QueueRef]] = {}
        for queue in queues:
            node = self._routes.node(queue.namespace, queue.topic)
            if node is None:
                node = await self._router.route(queue.namespace, queue.topic)
            split.setdefault(node, []).append(queue)
        for node in split:
            synced = node.synced_groups.get(ask.namespace)
            if node.alive and (synced is None or ask.group not in synced):
                await self._homes.sync_group(node, ask.namespace, ask.group)
        self._rotation += 1
        return await pop_spread(
            list(split.items()), ask, overflow=self._overflow, rotation=self._rotation
        )

    async def ack(self, namespace: str, group: str, receipt: str, *, durable: bool = True) -> None:
        node = self._router.receipt_node(receipt)
        handle = receipt[len(node.prefix) :]
        await self._router.send(node, lambda c: c.ack(namespace, group, handle, durable=durable))

    async def ack_many(
        self, namespace: str, group: str, receipts: Sequence[str], *, durable: bool = True
    ) -> list[str | None]:
        """Per node, one call each, at once. A receipt of a node that is down gets
        ``storage_unavailable`` (its message comes back after its invisibility)."""
        if not receipts:
            return []
        first = receipts[0]
        cut = first.find(":")
        node = self._routes.nodes.get(first[:cut]) if cut > 0 else None
        if node is not None and node.alive:
            prefix = node.prefix
            if all(r.startswith(prefix) for r in receipts):
                handles = [r[len(prefix) :] for r in receipts]
                return await self._router.send(
                    node, lambda c: c.ack_many(namespace, group, handles, durable=durable)
                )
        return await ack_spread(self._routes, namespace, group, receipts, durable=durable)

    async def change_invisibility(
        self, namespace: str, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        node = self._router.receipt_node(receipt)
        handle = receipt[len(node.prefix) :]
        message = await self._router.send(
            node, lambda c: c.change_invisibility(namespace, group, handle, invisible_ms)
        )
        return with_prefix([message], node.prefix)[0]

    async def nack(self, namespace: str, group: str, receipt: str, *, delay_ms: int = 0) -> None:
        node = self._router.receipt_node(receipt)
        handle = receipt[len(node.prefix) :]
        await self._router.send(node, lambda c: c.nack(namespace, group, handle, delay_ms=delay_ms))

    async def give_back(self, namespace: str, group: str, receipts: Sequence[str]) -> None:
        by_node: dict[Node, list[str]] = {}
        for receipt in receipts:
            node = self._router.receipt_node(receipt)
            by_node.setdefault(node, []).append(receipt[len(node.prefix) :])
        for node, handles in by_node.items():
            await self._give_back_on(node, namespace, group, handles)

    async def _give_back_on(
        self, node: Node, namespace: str, group: str, handles: list[str]
    ) -> None:
        await self._router.send(node, lambda c: c.give_back(namespace, group, handles))

    async def dead_letter(self, namespace: str, group: str, receipt: str) -> None:
        node = self._router.receipt_node(receipt)
        handle = receipt[len(node.prefix) :]
        await self._router.send(node, lambda c: c.dead_letter(namespace, group, handle))

    async def inflight_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.inflight_count(namespace, group, queue)
        )

    async def pending_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.pending_count(namespace, group, queue)
        )

    async def consumed_below(self, namespace: str, group: str, queue: QueueRef) -> int:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.consumed_below(namespace, group, queue)
        )

    async def delayed_count(self, namespace: str, queue: QueueRef) -> int:
        return await self._router.on_topic(
            queue.namespace, queue.topic, lambda c: c.delayed_count(namespace, queue)
        )

    # -- transactions ----------------------------------------------------------------

    async def append_half(
        self, request: AppendRequest, *, producer_group: str | None = None
    ) -> HalfMessage:
        """The half message's queues must all be on one node (commit is one engine's
        decision)."""
        api.check_append_queues(request)
        first = request.queues[0]
        for queue in request.queues[1:]:
            if (queue.namespace, queue.topic) == (first.namespace, first.topic):
                continue
            one = await self._router.locate(first.namespace, first.topic)
            other = await self._router.locate(queue.namespace, queue.topic)
            if one is not other:
                raise InvalidArgument(
                    "a transactional half message's queues must be on one storage node"
                )
        return await self._router.on_topic(
            first.namespace,
            first.topic,
            lambda c: c.append_half(request, producer_group=producer_group),
        )

    async def end_transaction(
        self, namespace: str, transaction_id: str, *, commit: bool
    ) -> AppendResult | None:
        """Sent to every live node at once: only the one holding the half has it."""
        results = await self._router.each_live(
            lambda c: c.end_transaction(namespace, transaction_id, commit=commit)
        )
        for _, result in results:
            if not isinstance(result, BaseException):
                return result
        self._router.none_down()  # it may be on a node that is down
        answers(results, absent=TransactionNotFound)
        raise TransactionNotFound(
            f"no undecided transaction {transaction_id!r} in namespace {namespace!r}"
        )

    async def list_undecided(
        self, namespace: str | None = None, *, older_than_ms: int = 0
    ) -> list[HalfMessage]:
        results = await self._router.each_live(
            lambda c: c.list_undecided(namespace, older_than_ms=older_than_ms)
        )
        return [half for halves in answers(results) for half in halves]

    # -- namespace-wide data on the home node ------------------------------------------

    async def put_latest(
        self, namespace: str, topic: str, key: bytes, message: Message | None
    ) -> None:
        check_name("topic", topic)
        await self._homes.call_home(
            namespace, lambda c: c.put_latest(namespace, topic, key, message)
        )

    async def get_latest(self, namespace: str, topic: str, key: bytes) -> Message | None:
        return await self._homes.call_if_home(
            namespace, lambda c: c.get_latest(namespace, topic, key), absent=None
        )

    async def list_latest(self, namespace: str, topic: str) -> list[tuple[bytes, Message]]:
        return await self._homes.call_if_home(
            namespace, lambda c: c.list_latest(namespace, topic), absent=[]
        )

    async def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        await self._homes.call_home(namespace, lambda c: c.meta_put(namespace, kind, name, value))

    async def meta_get(self, namespace: str, kind: str, name: str) -> Any | None:
        return await self._homes.call_if_home(
            namespace, lambda c: c.meta_get(namespace, kind, name), absent=None
        )

    async def meta_delete(self, namespace: str, kind: str, name: str) -> bool:
        return await self._homes.call_if_home(
            namespace, lambda c: c.meta_delete(namespace, kind, name), absent=False
        )

    async def meta_list(self, namespace: str, kind: str) -> dict[str, Any]:
        return await self._homes.call_if_home(
            namespace, lambda c: c.meta_list(namespace, kind), absent={}
        )
