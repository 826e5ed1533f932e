"""How the cluster client finds the node for a call, and what it does when that node
fails: routes kept fresh from the nameservers, lookups by topic, receipt and node id,
and fan-outs over every live node.

Kept apart from :mod:`storage.cluster` so the calls there read as "which node, then
what", and the rules for refreshing, for a node that is down and for a topic that
moved are read (and changed) in one place. The route cache itself, and how a
nameserver's table folds into it, is :mod:`storage.cluster_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from polymq.storage.clock import Clock
from polymq.storage.cluster_routes import Connect, Node, NodeClient, RouteCache, RouteSource
from polymq.storage.errors import (
    InvalidReceipt,
    NotSent,
    QueueNotFound,
    StorageError,
    StorageUnavailable,
    TopicNotFound,
)
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import AppendRequest, QueueRef

__all__ = ["NodeCall", "Router", "answers"]

log = logging.getLogger(__name__)

T = TypeVar("T")

NodeCall = Callable[[NodeClient], Awaitable[T]]

# How long the client of a node that moved stays open for the calls that picked it up.
_REPLACED_GRACE_S = 10.0
# How long a call its shard's old address refused waits for the routes to name the new
# one: a takeover is a lease time (3 s by default) and a rebuild.
_SHARD_MOVE_WAIT_S = 5.0
_SHARD_MOVE_POLL_S = 0.1


class Router:
    """The route cache of one cluster client, kept fresh, and the lookups its calls
    make. Refreshed every ``refresh_ms`` and at once on a miss; :meth:`start` waits up
    to ``start_timeout_s`` for a first live node, and goes on without one."""

    def __init__(
        self,
        source: RouteSource,
        connect: Connect,
        *,
        refresh_ms: int,
        start_timeout_s: float,
        clock: Clock,
    ) -> None:
        self.source = source
        self.cache = RouteCache(connect)
        self._refresh_s = refresh_ms / 1000
        self._start_timeout_s = start_timeout_s
        self._clock = clock
        # Shared by the callers waiting on it (never a background task: its failure
        # is theirs to see).
        self._fetching: asyncio.Task[None] | None = None
        # The refresher and the closing of clients of nodes gone from the routes.
        self._tasks = TaskSet("cluster router")

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Wait up to ``start_timeout_s`` for the nameservers to list a live node, then
        keep routes fresh. Finding none is not fatal: calls answer
        :class:`StorageUnavailable` (retryable) until the refresher sees a node, as a
        RabbitMQ node serves while a quorum queue's leader is away. A gateway that
        exited instead was restarted into the same wait while a shard moved or the
        pool restarted, and served nothing that was up meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        reason = "no storage node is registered"
        while True:
            try:
                await self.refresh()
            except StorageUnavailable as exc:
                reason = str(exc)
            if self.cache.has_live_node():
                break
            if loop.time() >= deadline:
                log.warning(
                    "no live storage node after %g s (%s): serving anyway, storage calls "
                    "answer 'unavailable' until a node registers",
                    self._start_timeout_s,
                    reason,
                )
                break
            await asyncio.sleep(min(0.1, self._refresh_s))
        self._tasks.spawn(self._refresh_loop(), name="polymq-cluster-routes")

    async def stop(self) -> None:
        """Stop refreshing; node clients stay open (calls may still be sent, and the
        refreshes they cause may still spawn: the task set closes with :meth:`close`)."""
        tasks = [*(t for t in (self._fetching,) if t is not None), *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close every node's client and the route source (if it has a ``close``),
        then end what the calls since :meth:`stop` left running."""
        for node in self.cache.nodes.values():
            try:
                await node.client.close()
            except Exception:
                log.exception("closing the client of storage node %s failed", node.node_id)
        close_source = getattr(self.source, "close", None)
        if close_source is not None:
            with contextlib.suppress(Exception):
                await close_source()
        await self._tasks.close()

    # -- refreshing ------------------------------------------------------------------

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
        table = await self.source.routes(self.cache.version)
        if table is None:
            return
        for client in self.cache.apply(table, self._clock.now_ms()):
            self._spawn(_close_later(client))

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

        self._tasks.spawn(run())

    # -- lookups ---------------------------------------------------------------------

    def cached(self, namespace: str, topic: str) -> Node | None:
        """The live node holding the topic, from the cache (the request path)."""
        nodes = self.cache.topics.get(namespace)
        if nodes is not None:
            node = nodes.get(topic)
            if node is not None and node.alive:
                return node
        return None

    async def route(self, namespace: str, topic: str) -> Node:
        """The topic's node after a cache miss: routes fetched anew. A node known to be
        down fails at once (its return is noticed by the background refresh), so an
        outage does not turn every call on its topics into a nameserver request."""
        node = self.cache.node(namespace, topic)
        if node is None:
            await self.refresh()
            node = self.cache.node(namespace, topic)
        if node is None and not self.cache.has_live_node():
            # No node to ask: the topic may well exist ("not found" would be a wrong
            # answer, and invite creating it again).
            raise StorageUnavailable("no live storage node")
        if node is None:
            raise TopicNotFound(f"topic {topic!r} does not exist in namespace {namespace!r}")
        if not node.alive:
            raise node.down()
        return node

    async def locate(self, namespace: str, topic: str) -> Node:
        """The topic's live node: from the cache, else after a refresh."""
        return self.cached(namespace, topic) or await self.route(namespace, topic)

    async def known_node(self, node_id: str) -> Node:
        node = self.cache.nodes.get(node_id)
        if node is None or not node.alive:
            await self.refresh()
            node = self.cache.nodes.get(node_id)
        if node is None:
            raise StorageUnavailable(f"storage node {node_id} is not in the routes")
        if not node.alive:
            raise node.down()
        return node

    def receipt_node(self, receipt: str) -> Node:
        cut = receipt.find(":")
        node = self.cache.nodes.get(receipt[:cut]) if cut > 0 else None
        if node is None:
            raise InvalidReceipt(f"receipt handle {receipt[:60]!r} names no known storage node")
        if not node.alive:
            raise node.down()
        return node

    def holder(self, queues: Sequence[QueueRef]) -> Node | None:
        """The live node holding all these queues, when one does (the common case:
        the call then goes to it unchanged)."""
        topics = self.cache.topics
        node: Node | None = None
        for queue in queues:
            by_topic = topics.get(queue.namespace)
            found = by_topic.get(queue.topic) if by_topic is not None else None
            if found is None or (node is not None and found is not node):
                return None
            node = found
        return node if node is not None and node.alive else None

    def one_node(self, requests: Sequence[AppendRequest]) -> Node | None:
        """The live node holding every queue of these requests, when one does."""
        node: Node | None = None
        for request in requests:
            found = self.holder(request.queues)
            if found is None or (node is not None and found is not node):
                return None
            node = found
        return node

    # -- calls on one node --------------------------------------------------------------

    async def send(self, node: Node, call: NodeCall[T]) -> T:
        """``call`` on ``node``; unanswered, as :meth:`resend` says."""
        try:
            return await call(node.client)
        except StorageUnavailable as exc:
            return await self.resend(exc, node, call)

    async def resend(self, exc: StorageUnavailable, node: Node, call: NodeCall[T]) -> T:
        """``call`` on ``node`` went unanswered with ``exc``. One that was never sent
        (:class:`NotSent`: the address refused the connection) goes once more to the
        node's new address, if the routes now give one: a shard of the replicated pool
        taken over by another process, or served again after a failed log, answers at
        a new port. Nothing was sent, so nothing is done twice, and the client sees a
        takeover as a wait (as a quorum queue's publisher waits for a new leader), not
        as an error it must retry. Otherwise the error says which node."""
        if isinstance(exc, NotSent) and await self._moved_from(node, exc.target):
            try:
                return await call(node.client)
            except StorageUnavailable as again:
                raise node.unreachable(again) from again
        raise node.unreachable(exc) from exc

    async def _moved_from(self, node: Node, target: str) -> bool:
        """Whether the routes now list ``node`` alive at an address other than
        ``target``, after a fetch; for a shard, fetched again until they do, for a
        takeover at most (its old owner may still be listed, or have expired from the
        routes, meanwhile). A plain node that is down stays down until someone
        restarts it: one fetch."""
        if not target:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (_SHARD_MOVE_WAIT_S if node.status.owner else 0.0)
        while True:
            with contextlib.suppress(StorageUnavailable):
                await self.refresh()
            moved = node.alive and node.where != target
            if moved or loop.time() >= deadline:
                return moved
            await asyncio.sleep(_SHARD_MOVE_POLL_S)

    # -- calls on one topic's node ---------------------------------------------------

    async def recover(
        self, exc: StorageError, node: Node, namespace: str, topic: str, call: NodeCall[T]
    ) -> T:
        """A topic's call failed on the cached node. Unreachable: as :meth:`resend`. No
        such topic or queue there: the topic may have been deleted and created again
        on another node; if the routes now say so, the call is sent there once."""
        if isinstance(exc, StorageUnavailable):
            return await self.resend(exc, node, call)
        if isinstance(exc, TopicNotFound | QueueNotFound):
            with contextlib.suppress(StorageUnavailable):
                await self.refresh()
            moved = self.cached(namespace, topic)
            if moved is not None and moved is not node:
                return await call(moved.client)
        raise exc

    async def on_topic(self, namespace: str, topic: str, call: NodeCall[T]) -> T:
        node = self.cached(namespace, topic) or await self.route(namespace, topic)
        try:
            return await call(node.client)
        except StorageError as exc:
            return await self.recover(exc, node, namespace, topic, call)

    # -- calls on every node ---------------------------------------------------------

    async def each_live(self, call: NodeCall[T]) -> list[tuple[Node, T | BaseException]]:
        """The call on every live node at once; each node's result or error."""
        nodes = self.cache.live_nodes()
        if not nodes:
            raise StorageUnavailable("no live storage node")
        results = await asyncio.gather(*(call(n.client) for n in nodes), return_exceptions=True)
        return list(zip(nodes, results, strict=True))

    def none_down(self) -> None:
        """Before answering "not found" for something any node may hold: raise
        :class:`StorageUnavailable` if a known node is down (it may be there)."""
        for node in self.cache.nodes.values():
            if not node.alive:
                raise node.down()

    def none_down_in(self, namespace: str) -> None:
        """Before a change to all of a namespace: raise :class:`StorageUnavailable` if a
        node holding one of its topics is down (the change would miss it)."""
        for topic, node in self.cache.topics.get(namespace, {}).items():
            if not node.alive:
                raise StorageUnavailable(
                    f"topic {topic!r} of namespace {namespace!r} is on storage node "
                    f"{node.node_id}, which is down"
                )


async def _close_later(client: NodeClient) -> None:
    """Close the client of a node that moved (a shard handed over) once the calls that
    picked it up just before the move are answered. Closed at once, such a call
    failed with ``StorageClosed`` (the client's own shutdown, which callers take as
    theirs: an MQTT session's pump stopped for good on one) instead of the
    retryable ``StorageUnavailable`` the old address answers with."""
    try:
        await asyncio.sleep(_REPLACED_GRACE_S)
    finally:
        await client.close()


def answers(
    results: list[tuple[Node, T | BaseException]], *, absent: type[StorageError] | None = None
) -> list[T]:
    """The answers of the nodes that answered. Unreachable nodes are left out (a list
    over the pool shows what is reachable) unless none answered; ``absent`` (the
    namespace is not on that node) counts as no answer, unless no node has it."""
    found: list[T] = []
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
            found.append(result)
    if not found:
        if unavailable:
            raise unavailable[0]
        if missing:
            raise missing[0]
    return found
