"""The storage API over a pool of storage nodes (the separated form, DESIGN.md section 4).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from storage.clock import Clock, SystemClock
from storage.cluster_pop import Overflow, pop_spread, with_prefix
from storage.cluster_routes import Connect, Node, NodeClient, RouteCache, RouteSource
from storage.engine.ids import MessageIds
from storage.errors import (
    InvalidArgument,
    InvalidReceipt,
    NamespaceAlreadyExists,
    NamespaceNotFound,
    QueueNotFound,
    StorageError,
    StorageUnavailable,
    TopicAlreadyExists,
    TopicNotFound,
    TransactionNotFound,
)
from storage.model import (
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
from storage.names import check_name

__all__ = ["ClusterStorage", "NodeClient", "RouteSource"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_INVALID_RECEIPT = InvalidReceipt.code
_UNAVAILABLE = StorageUnavailable.code


class ClusterStorage:
    """:class:`storage.api.StorageAPI` over the storage nodes a nameserver lists.

    ``route_source`` answers routes and placements (a ``NameserverClient``);
    ``connect`` makes the client of one node (a ``RemoteStorage``); :meth:`close`
    closes both (the route source if it has a ``close``). Routes are refreshed every
    ``refresh_ms`` and at once on a miss; :meth:`start` waits up to
    ``start_timeout_s`` for a first live node.

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
        self._source = route_source
        self._routes = RouteCache(connect)
        self._refresh_s = refresh_ms / 1000
        self._start_timeout_s = start_timeout_s
        self._clock: Clock = clock or SystemClock()
        self._overflow = Overflow()
        # Ids for appends spread over nodes: this gateway's own random node id, in the
        # engine's RocketMQ-shaped format.
        self._ids = MessageIds(secrets.token_bytes(6))
        self._rotation = 0
        self._fetching: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Wait until the nameservers list a live node, then keep routes fresh."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        reason = "no storage node is registered"
        while True:
            try:
                await self.refresh()
            except StorageUnavailable as exc:
                reason = str(exc)
            if self._routes.has_live_node():
                break
            if loop.time() >= deadline:
                raise StorageUnavailable(
                    f"no live storage node after {self._start_timeout_s:g} s: {reason}"
                )
            await asyncio.sleep(min(0.1, self._refresh_s))
        self._refresher = loop.create_task(self._refresh_loop(), name="polymq-cluster-routes")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._refresher, self._fetching) if t is not None]
        tasks += self._background
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._give_back_overflow()
        for node in self._routes.nodes.values():
            try:
                await node.client.close()
            except Exception:
                log.exception("closing the client of storage node %s failed", node.node_id)
        close_source = getattr(self._source, "close", None)
        if close_source is not None:
            with contextlib.suppress(Exception):
                await close_source()

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
        if self._fetching is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._fetching)
        if self._fetching is None:
            task = asyncio.get_running_loop().create_task(self._fetch())
            task.add_done_callback(self._fetched)
            self._fetching = task
        await asyncio.shield(self._fetching)

    def _fetched(self, task: asyncio.Task[None]) -> None:
        if self._fetching is task:
            self._fetching = None
        if not task.cancelled():
            task.exception()  # retrieved here; the callers awaiting it re-raise it

    async def _fetch(self) -> None:
        table = await self._source.routes(self._routes.version)
        if table is None:
            return
        for client in self._routes.apply(table, self._clock.now_ms()):
            self._spawn(client.close())

    async def _refresh_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception as exc:
                if not failing:
                    log.warning("route refresh failed (cached routes stay in use): %s", exc)
                failing = True
            else:
                if failing:
                    log.info("route refresh works again")
                failing = False

    def _spawn(self, coro: Awaitable[Any]) -> None:
        async def run() -> None:
            with contextlib.suppress(Exception):
                await coro

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _cached(self, namespace: str, topic: str) -> Node | None:
        """The live node holding the topic, from the cache (the request path)."""
        nodes = self._routes.topics.get(namespace)
        if nodes is not None:
            node = nodes.get(topic)
            if node is not None and node.alive:
                return node
        return None

    async def _route(self, namespace: str, topic: str) -> Node:
        """The topic's node after a cache miss: routes fetched anew. A node known to be
        down fails at once (its return is noticed by the background refresh), so an
        outage does not turn every call on its topics into a nameserver request."""
        node = self._routes.node(namespace, topic)
        if node is None:
            await self.refresh()
            node = self._routes.node(namespace, topic)
        if node is None:
            raise TopicNotFound(f"topic {topic!r} does not exist in namespace {namespace!r}")
        if not node.alive:
            raise node.down()
        return node

    async def _known_node(self, node_id: str) -> Node:
        node = self._routes.nodes.get(node_id)
        if node is None or not node.alive:
            await self.refresh()
            node = self._routes.nodes.get(node_id)
        if node is None:
            raise StorageUnavailable(f"storage node {node_id} is not in the routes")
        if not node.alive:
            raise node.down()
        return node

    async def _recover(
        self,
        exc: StorageError,
        node: Node,
        namespace: str,
        topic: str,
        call: Callable[[NodeClient], Awaitable[T]],
    ) -> T:
        """A topic's call failed on the cached node. Unreachable: say which node. No
        such topic or queue there: the topic may have been deleted and created again
        on another node; if the routes now say so, the call is sent there once."""
        if isinstance(exc, StorageUnavailable):
            raise node.unreachable(exc) from exc
        if isinstance(exc, TopicNotFound | QueueNotFound):
            with contextlib.suppress(StorageUnavailable):
                await self.refresh()
            moved = self._cached(namespace, topic)
            if moved is not None and moved is not node:
                return await call(moved.client)
        raise exc

    async def _on_topic(
        self, namespace: str, topic: str, call: Callable[[NodeClient], Awaitable[T]]
    ) -> T:
        node = self._cached(namespace, topic) or await self._route(namespace, topic)
        try:
            return await call(node.client)
        except StorageError as exc:
            return await self._recover(exc, node, namespace, topic, call)

    def _receipt_node(self, receipt: str) -> Node:
        cut = receipt.find(":")
        node = self._routes.nodes.get(receipt[:cut]) if cut > 0 else None
        if node is None:
            raise InvalidReceipt(f"receipt handle {receipt[:60]!r} names no known storage node")
        if not node.alive:
            raise node.down()
        return node

    async def _each_live(
        self, call: Callable[[NodeClient], Awaitable[T]]
    ) -> list[tuple[Node, T | BaseException]]:
        """The call on every live node at once; each node's result or error."""
        nodes = self._routes.live_nodes()
        if not nodes:
            raise StorageUnavailable("no live storage node")
        results = await asyncio.gather(*(call(n.client) for n in nodes), return_exceptions=True)
        return list(zip(nodes, results, strict=True))

    def _none_down(self) -> None:
        """Before answering "not found" for something any node may hold: raise
        :class:`StorageUnavailable` if a known node is down (it may be there)."""
        for node in self._routes.nodes.values():
            if not node.alive:
                raise node.down()

    def _none_down_in(self, namespace: str) -> None:
        """Before a change to all of a namespace: raise :class:`StorageUnavailable` if a
        node holding one of its topics is down (the change would miss it)."""
        for topic, node in self._routes.topics.get(namespace, {}).items():
            if not node.alive:
                raise StorageUnavailable(
                    f"topic {topic!r} of namespace {namespace!r} is on storage node "
                    f"{node.node_id}, which is down"
                )

    @staticmethod
    def _answers(
        results: list[tuple[Node, T | BaseException]], *, absent: type[StorageError] | None = None
    ) -> list[T]:
        """The answers of the nodes that answered. Unreachable nodes are left out (a
        list over the pool shows what is reachable) unless none answered; ``absent``
        (the namespace is not on that node) counts as no answer, unless no node has it."""
        answers: list[T] = []
        unavailable: list[StorageUnavailable] = []
        missing: list[StorageError] = []
        for node, result in results:
            if isinstance(result, StorageUnavailable):
                unavailable.append(node.unreachable(result))
            elif absent is not None and isinstance(result, absent):
                missing.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                answers.append(result)
        if not answers:
            if unavailable:
                raise unavailable[0]
            if missing:
                raise missing[0]
        return answers

    # -- namespaces ------------------------------------------------------------------

    async def _namespace_exists(self, namespace: str, *, besides: Node | None = None) -> bool:
        """Whether a live node (other than ``besides``) has the namespace."""
        results = await self._each_live(lambda c: c.list_namespaces())
        names = [r for node, r in results if node is not besides]
        if not any(isinstance(r, list) for r in names) and any(
            isinstance(r, StorageUnavailable) for r in names
        ):
            raise StorageUnavailable(f"no storage node answered about namespace {namespace!r}")
        return any(isinstance(r, list) and namespace in r for r in names)

    async def _with_namespace(
        self, node: Node, namespace: str, call: Callable[[NodeClient], Awaitable[T]]
    ) -> T:
        """Run a call that needs the namespace on ``node``. A node that joined (or was
        down) after the namespace was created lacks it: create it there when another
        node has it, so the namespace exists wherever its data goes."""
        try:
            return await call(node.client)
        except NamespaceNotFound:
            if not await self._namespace_exists(namespace, besides=node):
                raise
        except StorageUnavailable as exc:
            raise node.unreachable(exc) from exc
        try:
            with contextlib.suppress(NamespaceAlreadyExists):
                await node.client.create_namespace(namespace)
            return await call(node.client)
        except StorageUnavailable as exc:
            raise node.unreachable(exc) from exc

    async def create_namespace(self, namespace: str) -> None:
        """On every live node. A namespace exists where any node has it; nodes that
        lack it (down meanwhile, joined later) get it when first used there."""
        check_name("namespace", namespace)
        results = await self._each_live(lambda c: c.create_namespace(namespace))
        self._answers(results, absent=NamespaceAlreadyExists)
        if any(isinstance(r, NamespaceAlreadyExists) for _, r in results):
            raise NamespaceAlreadyExists(f"namespace {namespace!r} already exists")

    async def delete_namespace(self, namespace: str) -> None:
        """Only when no node, reachable or not, holds a topic of it."""
        self._none_down_in(namespace)
        listed = await self._each_live(lambda c: c.list_topics(namespace, include_internal=True))
        for node, result in listed:
            if isinstance(result, StorageUnavailable):
                raise node.unreachable(result)
            if isinstance(result, list) and result:
                raise InvalidArgument(f"namespace {namespace!r} still has topics")
        results = await self._each_live(lambda c: c.delete_namespace(namespace))
        self._answers(results, absent=NamespaceNotFound)
        self._routes.remove_namespace(namespace)

    async def list_namespaces(self) -> list[str]:
        results = await self._each_live(lambda c: c.list_namespaces())
        return sorted({name for names in self._answers(results) for name in names})

    # -- topics and queues -----------------------------------------------------------

    async def create_topic(
        self, namespace: str, topic: str, config: TopicConfig = TopicConfig()
    ) -> TopicInfo:
        """On the node a nameserver places it on (the least loaded), whole."""
        check_name("topic", topic)
        node = await self._known_node(await self._source.place_topic(namespace, topic))
        try:
            info = await self._with_namespace(
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
        return await self._on_topic(
            namespace, topic, lambda c: c.alter_topic(namespace, topic, config)
        )

    async def delete_topic(self, namespace: str, topic: str) -> None:
        await self._on_topic(namespace, topic, lambda c: c.delete_topic(namespace, topic))
        self._routes.remove_topic(namespace, topic)

    async def list_topics(
        self, namespace: str, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        results = await self._each_live(
            lambda c: c.list_topics(namespace, include_internal=include_internal)
        )
        found: dict[str, TopicInfo] = {}
        for node, result in results:
            if isinstance(result, list):
                for info in result:
                    # A topic two nodes hold (a conflict the nameserver logs): the routed one.
                    if info.name not in found or self._routes.node(namespace, info.name) is node:
                        found[info.name] = info
        self._answers(results, absent=NamespaceNotFound)
        return [found[name] for name in sorted(found)]

    async def describe_topic(self, namespace: str, topic: str) -> TopicInfo:
        return await self._on_topic(namespace, topic, lambda c: c.describe_topic(namespace, topic))

    async def queue_offsets(self, queue: QueueRef) -> QueueOffsets:
        return await self._on_topic(queue.namespace, queue.topic, lambda c: c.queue_offsets(queue))

    async def delete_records(self, queue: QueueRef, before_offset: int) -> QueueOffsets:
        return await self._on_topic(
            queue.namespace, queue.topic, lambda c: c.delete_records(queue, before_offset)
        )

    async def offset_for_timestamp(self, queue: QueueRef, timestamp_ms: int) -> int:
        return await self._on_topic(
            queue.namespace, queue.topic, lambda c: c.offset_for_timestamp(queue, timestamp_ms)
        )

    async def compact(
        self,
        queue: QueueRef,
        drop: Sequence[int] = (),
        rewrite: Mapping[int, BatchEntry] | None = None,
    ) -> int:
        return await self._on_topic(
            queue.namespace, queue.topic, lambda c: c.compact(queue, drop, rewrite)
        )

    # -- append ----------------------------------------------------------------------

    def _holder(self, queues: Sequence[QueueRef]) -> Node | None:
        """The live node holding all these queues, when one does (the common case:
        the call then goes to it unchanged)."""
        topics = self._routes.topics
        node: Node | None = None
        for queue in queues:
            by_topic = topics.get(queue.namespace)
            found = by_topic.get(queue.topic) if by_topic is not None else None
            if found is None or (node is not None and found is not node):
                return None
            node = found
        return node if node is not None and node.alive else None

    def _one_node(self, requests: Sequence[AppendRequest]) -> Node | None:
        """The live node holding every queue of these requests, when one does."""
        node: Node | None = None
        for request in requests:
            found = self._holder(request.queues)
            if found is None or (node is not None and found is not node):
                return None
            node = found
        return node

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        node = self._one_node(requests)
        if node is None:
            return await self._append_spread(requests)
        try:
            return await node.client.append(requests)
        except StorageError as exc:
            if isinstance(exc, StorageUnavailable):
                raise node.unreachable(exc) from exc
            if not isinstance(exc, TopicNotFound | QueueNotFound):
                raise
            with contextlib.suppress(StorageUnavailable):
                await self.refresh()
            if self._one_node(requests) is node:
                raise
            return await self._append_spread(requests)

    async def _append_spread(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        """Each request split per node (same entry, same dedup key), one append call
        per node for all its shares, at once; results merged back per request."""
        shares: dict[Node, list[AppendRequest]] = {}
        # Per request: (node, index of its share in that node's call), first queue's first.
        where: list[list[tuple[Node, int]]] = []
        for request in requests:
            if not request.queues:
                raise InvalidArgument("an append needs at least one queue")
            split: dict[Node, list[QueueRef]] = {}
            for queue in request.queues:
                node = self._cached(queue.namespace, queue.topic) or await self._route(
                    queue.namespace, queue.topic
                )
                split.setdefault(node, []).append(queue)
            places = []
            # One name for every copy, so each protocol reports the same message id.
            message_id = request.message_id or (
                self._ids.next(self._clock.now_ms()) if len(split) > 1 else None
            )
            for node, queues in split.items():
                share = (
                    request
                    if len(split) == 1
                    else AppendRequest(
                        entry=request.entry,
                        queues=tuple(queues),
                        dedup_key=request.dedup_key,
                        message_id=message_id,
                    )
                )
                calls = shares.setdefault(node, [])
                places.append((node, len(calls)))
                calls.append(share)
            where.append(places)
        nodes = list(shares)
        answers = await asyncio.gather(
            *(n.client.append(shares[n]) for n in nodes), return_exceptions=True
        )
        by_node: dict[Node, list[AppendResult]] = {}
        for node, answer in zip(nodes, answers, strict=True):
            if isinstance(answer, StorageUnavailable):
                raise node.unreachable(answer)
            if isinstance(answer, BaseException):
                raise answer
            by_node[node] = answer
        return [
            _merge(request, [by_node[node][i] for node, i in places])
            for request, places in zip(requests, where, strict=True)
        ]

    async def cancel_delayed(self, namespace: str, message_id: str) -> bool:
        """Asked of every live node: one holds it, or several (a spread append)."""
        results = await self._each_live(lambda c: c.cancel_delayed(namespace, message_id))
        if any(r is True for _, r in results):
            return True
        self._answers(results)
        self._none_down()  # it may be on a node that is down
        return False

    # -- reads (offset mode) ---------------------------------------------------------

    async def read(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = 32,
        max_bytes: int = 1 << 20,
        wait_ms: int = 0,
    ) -> ReadResult:
        node = self._cached(queue.namespace, queue.topic) or await self._route(
            queue.namespace, queue.topic
        )
        try:
            return await node.client.read(
                queue, offset, max_messages=max_messages, max_bytes=max_bytes, wait_ms=wait_ms
            )
        except StorageError as exc:
            return await self._recover(
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
        max_bytes: int = 1 << 20,
        wait_ms: int = 0,
    ) -> list[StoredBatch]:
        node = self._cached(queue.namespace, queue.topic) or await self._route(
            queue.namespace, queue.topic
        )
        try:
            return await node.client.read_batches(
                queue, offset, max_bytes=max_bytes, wait_ms=wait_ms
            )
        except StorageError as exc:
            return await self._recover(
                exc,
                node,
                queue.namespace,
                queue.topic,
                lambda c: c.read_batches(queue, offset, max_bytes=max_bytes, wait_ms=wait_ms),
            )

    async def commit_offset(
        self, namespace: str, group: str, queue: QueueRef, offset: int, metadata: str = ""
    ) -> None:
        node = self._cached(queue.namespace, queue.topic) or await self._route(
            queue.namespace, queue.topic
        )
        try:
            await node.client.commit_offset(namespace, group, queue, offset, metadata)
        except StorageError as exc:
            await self._recover(
                exc,
                node,
                queue.namespace,
                queue.topic,
                lambda c: c.commit_offset(namespace, group, queue, offset, metadata),
            )

    async def fetch_offset(
        self, namespace: str, group: str, queue: QueueRef
    ) -> CommittedOffset | None:
        node = self._cached(queue.namespace, queue.topic) or await self._route(
            queue.namespace, queue.topic
        )
        try:
            return await node.client.fetch_offset(namespace, group, queue)
        except StorageError as exc:
            return await self._recover(
                exc,
                node,
                queue.namespace,
                queue.topic,
                lambda c: c.fetch_offset(namespace, group, queue),
            )

    async def list_group_offsets(
        self, namespace: str, group: str
    ) -> dict[QueueRef, CommittedOffset]:
        results = await self._each_live(lambda c: c.list_group_offsets(namespace, group))
        merged: dict[QueueRef, CommittedOffset] = {}
        for offsets in self._answers(results):
            merged.update(offsets)
        return merged

    async def delete_group_offsets(
        self, namespace: str, group: str, queues: Sequence[QueueRef] | None = None
    ) -> None:
        if queues is None:
            self._none_down_in(namespace)  # its offsets there would outlive the delete
            results = await self._each_live(lambda c: c.delete_group_offsets(namespace, group))
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
            node = self._cached(queue.namespace, queue.topic) or await self._route(
                queue.namespace, queue.topic
            )
            split.setdefault(node, []).append(queue)
        for node, part in split.items():
            try:
                await node.client.delete_group_offsets(namespace, group, part)
            except StorageUnavailable as exc:
                raise node.unreachable(exc) from exc

    async def list_groups(self, namespace: str) -> list[str]:
        results = await self._each_live(lambda c: c.list_groups(namespace))
        return sorted({g for groups in self._answers(results) for g in groups})

    # -- pop mode (queue semantics) --------------------------------------------------

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None:
        """On the home node (the authority; it must succeed), then on every other live
        node, where pops run. A node that misses it gets it before its next pop."""
        check_name("group", group)
        home = await self._home_for_write(namespace)
        await self._with_namespace(
            home, namespace, lambda c: c.set_group_config(namespace, group, config)
        )
        home.synced_groups.setdefault(namespace, set()).add(group)
        others = [n for n in self._routes.live_nodes() if n is not home]
        results = await asyncio.gather(
            *(
                self._with_namespace(
                    n, namespace, lambda c: c.set_group_config(namespace, group, config)
                )
                for n in others
            ),
            return_exceptions=True,
        )
        for node, result in zip(others, results, strict=True):
            synced = node.synced_groups.setdefault(namespace, set())
            if isinstance(result, BaseException):
                synced.discard(group)
                log.warning(
                    "group config %s/%s not set on storage node %s (set before its next pop): %s",
                    namespace,
                    group,
                    node.node_id,
                    result,
                )
            else:
                synced.add(group)

    async def get_group_config(self, namespace: str, group: str) -> GroupConfig:
        home = await self._home(namespace)
        if home is None:
            return GroupConfig()
        return await self._home_call(home, lambda c: c.get_group_config(namespace, group))

    async def _sync_group(self, node: Node, namespace: str, group: str) -> None:
        """Give ``node`` the group's config from the home node before it pops for the
        group (it may have been down, or not yet in the pool, when it was set)."""
        try:
            home = self._routes.homes.get(namespace)
            if home is not None and home is not node:
                if not home.alive:
                    return  # checked again at the next pop
                wanted = await home.client.get_group_config(namespace, group)
                if await node.client.get_group_config(namespace, group) != wanted:
                    await node.client.set_group_config(namespace, group, wanted)
            node.synced_groups.setdefault(namespace, set()).add(group)
        except StorageError as exc:
            log.warning(
                "group config %s/%s not checked on storage node %s: %s",
                namespace,
                group,
                node.node_id,
                exc,
            )

    async def pop(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int = 1,
        invisible_ms: int = 30_000,
        wait_ms: int = 0,
        tags: frozenset[str] | None = None,
        durable: bool = True,
    ) -> list[StoredMessage]:
        if self._overflow:
            held = self._overflow.take(
                namespace, group, queues, tags, max_messages, self._clock.now_ms()
            )
            if held:
                return held
        node = self._holder(queues)
        if node is None:
            return await self._pop_spread(
                namespace,
                group,
                queues,
                max_messages=max_messages,
                invisible_ms=invisible_ms,
                wait_ms=wait_ms,
                tags=tags,
                durable=durable,
            )
        synced = node.synced_groups.get(namespace)
        if synced is None or group not in synced:
            await self._sync_group(node, namespace, group)
        try:
            popped = await node.client.pop(
                namespace,
                group,
                queues,
                max_messages=max_messages,
                invisible_ms=invisible_ms,
                wait_ms=wait_ms,
                tags=tags,
                durable=durable,
            )
        except StorageUnavailable as exc:
            raise node.unreachable(exc) from exc
        return with_prefix(popped, node.prefix)

    async def _pop_spread(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int,
        invisible_ms: int,
        wait_ms: int,
        tags: frozenset[str] | None,
        durable: bool,
    ) -> list[StoredMessage]:
        check_name("group", group)
        if max_messages < 1:
            raise InvalidArgument("max_messages must be at least 1")
        if invisible_ms < 0:
            raise InvalidArgument("invisible_ms must not be negative")
        if not queues:
            raise InvalidArgument("pop needs at least one queue")
        split: dict[Node, list[QueueRef]] = {}
        for queue in queues:
            node = self._routes.node(queue.namespace, queue.topic)
            if node is None:
                node = await self._route(queue.namespace, queue.topic)
            split.setdefault(node, []).append(queue)
        for node in split:
            synced = node.synced_groups.get(namespace)
            if node.alive and (synced is None or group not in synced):
                await self._sync_group(node, namespace, group)
        self._rotation += 1
        return await pop_spread(
            list(split.items()),
            namespace,
            group,
            max_messages=max_messages,
            invisible_ms=invisible_ms,
            wait_ms=wait_ms,
            tags=tags,
            durable=durable,
            overflow=self._overflow,
            rotation=self._rotation,
        )

    async def ack(self, namespace: str, group: str, receipt: str) -> None:
        node = self._receipt_node(receipt)
        try:
            await node.client.ack(namespace, group, receipt[len(node.prefix) :])
        except StorageUnavailable as exc:
            raise node.unreachable(exc) from exc

    async def ack_many(
        self, namespace: str, group: str, receipts: Sequence[str]
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
                size = len(prefix)
                try:
                    return await node.client.ack_many(
                        namespace, group, [r[size:] for r in receipts]
                    )
                except StorageUnavailable as exc:
                    raise node.unreachable(exc) from exc
        return await self._ack_spread(namespace, group, receipts)

    async def _ack_spread(
        self, namespace: str, group: str, receipts: Sequence[str]
    ) -> list[str | None]:
        outcomes: list[str | None] = [None] * len(receipts)
        split: dict[Node, list[int]] = {}
        for i, receipt in enumerate(receipts):
            cut = receipt.find(":")
            node = self._routes.nodes.get(receipt[:cut]) if cut > 0 else None
            if node is None:
                outcomes[i] = _INVALID_RECEIPT
            elif not node.alive:
                outcomes[i] = _UNAVAILABLE
            else:
                split.setdefault(node, []).append(i)
        nodes = list(split)
        answers = await asyncio.gather(
            *(
                n.client.ack_many(
                    namespace, group, [receipts[i][len(n.prefix) :] for i in split[n]]
                )
                for n in nodes
            ),
            return_exceptions=True,
        )
        for node, answer in zip(nodes, answers, strict=True):
            if isinstance(answer, StorageUnavailable):
                for i in split[node]:
                    outcomes[i] = _UNAVAILABLE
            elif isinstance(answer, BaseException):
                raise answer
            else:
                for i, outcome in zip(split[node], answer, strict=True):
                    outcomes[i] = outcome
        return outcomes

    async def change_invisibility(
        self, namespace: str, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        node = self._receipt_node(receipt)
        try:
            message = await node.client.change_invisibility(
                namespace, group, receipt[len(node.prefix) :], invisible_ms
            )
        except StorageUnavailable as exc:
            raise node.unreachable(exc) from exc
        return with_prefix([message], node.prefix)[0]

    async def nack(self, namespace: str, group: str, receipt: str, *, delay_ms: int = 0) -> None:
        node = self._receipt_node(receipt)
        try:
            await node.client.nack(namespace, group, receipt[len(node.prefix) :], delay_ms=delay_ms)
        except StorageUnavailable as exc:
            raise node.unreachable(exc) from exc

    async def dead_letter(self, namespace: str, group: str, receipt: str) -> None:
        node = self._receipt_node(receipt)
        try:
            await node.client.dead_letter(namespace, group, receipt[len(node.prefix) :])
        except StorageUnavailable as exc:
            raise node.unreachable(exc) from exc

    async def inflight_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return await self._on_topic(
            queue.namespace, queue.topic, lambda c: c.inflight_count(namespace, group, queue)
        )

    async def pending_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return await self._on_topic(
            queue.namespace, queue.topic, lambda c: c.pending_count(namespace, group, queue)
        )

    async def consumed_below(self, namespace: str, group: str, queue: QueueRef) -> int:
        return await self._on_topic(
            queue.namespace, queue.topic, lambda c: c.consumed_below(namespace, group, queue)
        )

    async def delayed_count(self, namespace: str, queue: QueueRef) -> int:
        return await self._on_topic(
            queue.namespace, queue.topic, lambda c: c.delayed_count(namespace, queue)
        )

    # -- transactions ----------------------------------------------------------------

    async def append_half(
        self, request: AppendRequest, *, producer_group: str | None = None
    ) -> HalfMessage:
        """The half message's queues must all be on one node (commit is one engine's
        decision)."""
        if not request.queues:
            raise InvalidArgument("an append needs at least one queue")
        first = request.queues[0]
        for queue in request.queues[1:]:
            if (queue.namespace, queue.topic) == (first.namespace, first.topic):
                continue
            one = self._cached(first.namespace, first.topic) or await self._route(
                first.namespace, first.topic
            )
            other = self._cached(queue.namespace, queue.topic) or await self._route(
                queue.namespace, queue.topic
            )
            if one is not other:
                raise InvalidArgument(
                    "a transactional half message's queues must be on one storage node"
                )
        return await self._on_topic(
            first.namespace,
            first.topic,
            lambda c: c.append_half(request, producer_group=producer_group),
        )

    async def end_transaction(
        self, namespace: str, transaction_id: str, *, commit: bool
    ) -> AppendResult | None:
        """Sent to every live node at once: only the one holding the half has it."""
        results = await self._each_live(
            lambda c: c.end_transaction(namespace, transaction_id, commit=commit)
        )
        for _, result in results:
            if not isinstance(result, BaseException):
                return result
        self._none_down()  # it may be on a node that is down
        self._answers(results, absent=TransactionNotFound)
        raise TransactionNotFound(
            f"no undecided transaction {transaction_id!r} in namespace {namespace!r}"
        )

    async def list_undecided(
        self, namespace: str | None = None, *, older_than_ms: int = 0
    ) -> list[HalfMessage]:
        results = await self._each_live(
            lambda c: c.list_undecided(namespace, older_than_ms=older_than_ms)
        )
        return [half for halves in self._answers(results) for half in halves]

    # -- namespace-wide data on the home node ------------------------------------------

    async def _home(self, namespace: str) -> Node | None:
        """The namespace's home node, claimed on first use; ``None`` if no node has
        the namespace."""
        node = self._routes.homes.get(namespace)
        if node is None:
            await self.refresh()
            node = self._routes.homes.get(namespace)
        if node is None:
            # A node's claim creates the namespace there: first make sure it exists.
            if not await self._namespace_exists(namespace):
                return None
            node = await self._known_node(await self._source.place_home(namespace))
            await self._with_namespace(node, namespace, lambda c: c.claim_home(namespace))
            self._routes.add_home(namespace, node, self._clock.now_ms())
        if not node.alive:
            raise node.down()
        return node

    async def _home_for_write(self, namespace: str) -> Node:
        node = await self._home(namespace)
        if node is None:
            raise NamespaceNotFound(f"namespace {namespace!r} does not exist")
        return node

    async def _home_call(self, home: Node, call: Callable[[NodeClient], Awaitable[T]]) -> T:
        try:
            return await call(home.client)
        except StorageUnavailable as exc:
            raise home.unreachable(exc) from exc

    async def put_latest(
        self, namespace: str, topic: str, key: bytes, message: Message | None
    ) -> None:
        check_name("topic", topic)
        home = await self._home_for_write(namespace)
        await self._home_call(home, lambda c: c.put_latest(namespace, topic, key, message))

    async def get_latest(self, namespace: str, topic: str, key: bytes) -> Message | None:
        home = await self._home(namespace)
        if home is None:
            return None
        return await self._home_call(home, lambda c: c.get_latest(namespace, topic, key))

    async def list_latest(self, namespace: str, topic: str) -> list[tuple[bytes, Message]]:
        home = await self._home(namespace)
        if home is None:
            return []
        return await self._home_call(home, lambda c: c.list_latest(namespace, topic))

    async def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        home = await self._home_for_write(namespace)
        await self._home_call(home, lambda c: c.meta_put(namespace, kind, name, value))

    async def meta_get(self, namespace: str, kind: str, name: str) -> Any | None:
        home = await self._home(namespace)
        if home is None:
            return None
        return await self._home_call(home, lambda c: c.meta_get(namespace, kind, name))

    async def meta_delete(self, namespace: str, kind: str, name: str) -> bool:
        home = await self._home(namespace)
        if home is None:
            return False
        return await self._home_call(home, lambda c: c.meta_delete(namespace, kind, name))

    async def meta_list(self, namespace: str, kind: str) -> dict[str, Any]:
        home = await self._home(namespace)
        if home is None:
            return {}
        return await self._home_call(home, lambda c: c.meta_list(namespace, kind))


def _merge(request: AppendRequest, parts: list[AppendResult]) -> AppendResult:
    """One request's results from the nodes its queues are on, as one result:
    placements in the request's queue order, the first queue's node's id and time."""
    if len(parts) == 1:
        return parts[0]
    order = {queue: i for i, queue in enumerate(request.queues)}
    placements = sorted(
        (p for part in parts for p in part.placements), key=lambda p: order[p.queue]
    )
    return AppendResult(
        message_id=parts[0].message_id,
        store_timestamp_ms=parts[0].store_timestamp_ms,
        placements=tuple(placements),
        duplicate=all(part.duplicate for part in parts),
    )
