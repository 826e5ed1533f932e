"""Namespace-wide data in the separated form: each namespace's home node, and group
configs, which pops need on every node.

A namespace's metadata, keyed latest values and group configs live on one node, its
*home*, claimed the first time the namespace is used (a nameserver picks the node,
the node persists the claim and reports it in its heartbeats). A namespace exists
wherever any node has it: a node that joined or was down when it was created gets it
when first used there. Group configs are the one namespace-wide datum that other
nodes need too (their engines run the pops), so the home's copy is pushed to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TypeVar

from polymq.storage.clock import Clock
from polymq.storage.cluster_router import NodeCall, Router
from polymq.storage.cluster_routes import Node
from polymq.storage.errors import (
    NamespaceAlreadyExists,
    NamespaceNotFound,
    StorageError,
    StorageUnavailable,
)
from polymq.storage.model import GroupConfig

__all__ = ["Homes"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Homes:
    """Finds, claims and calls namespaces' home nodes, through ``router``."""

    def __init__(self, router: Router, clock: Clock) -> None:
        self._router = router
        self._clock = clock

    async def exists(self, namespace: str, *, besides: Node | None = None) -> bool:
        """Whether a live node (other than ``besides``) has the namespace."""
        results = await self._router.each_live(lambda c: c.list_namespaces())
        names = [r for node, r in results if node is not besides]
        if not any(isinstance(r, list) for r in names) and any(
            isinstance(r, StorageUnavailable) for r in names
        ):
            raise StorageUnavailable(f"no storage node answered about namespace {namespace!r}")
        return any(isinstance(r, list) and namespace in r for r in names)

    async def with_namespace(self, node: Node, namespace: str, call: NodeCall[T]) -> T:
        """Run a call that needs the namespace on ``node``. A node that joined (or was
        down) after the namespace was created lacks it: create it there when another
        node has it, so the namespace exists wherever its data goes."""
        try:
            return await self._router.send(node, call)
        except NamespaceNotFound:
            if not await self.exists(namespace, besides=node):
                raise
        with contextlib.suppress(NamespaceAlreadyExists):
            await self._router.send(node, lambda c: c.create_namespace(namespace))
        return await self._router.send(node, call)

    async def home(self, namespace: str) -> Node | None:
        """The namespace's home node, claimed on first use; ``None`` if no node has
        the namespace."""
        routes = self._router.cache
        node = routes.homes.get(namespace)
        if node is None:
            await self._router.refresh()
            node = routes.homes.get(namespace)
        if node is None:
            # A node's claim creates the namespace there: first make sure it exists.
            if not await self.exists(namespace):
                return None
            node = await self._router.known_node(await self._router.source.place_home(namespace))
            await self.with_namespace(node, namespace, lambda c: c.claim_home(namespace))
            routes.add_home(namespace, node, self._clock.now_ms())
        if not node.alive:
            raise node.down()
        return node

    async def home_for_write(self, namespace: str) -> Node:
        node = await self.home(namespace)
        if node is None:
            raise NamespaceNotFound(f"namespace {namespace!r} does not exist")
        return node

    async def call_if_home(self, namespace: str, call: NodeCall[T], *, absent: T) -> T:
        """``call`` on the namespace's home node; ``absent`` if no node has the
        namespace (so nothing namespace-wide is stored yet)."""
        home = await self.home(namespace)
        return absent if home is None else await self._router.send(home, call)

    async def call_home(self, namespace: str, call: NodeCall[T]) -> T:
        """``call`` on the namespace's home node, which must exist."""
        return await self._router.send(await self.home_for_write(namespace), call)

    # -- group configs ---------------------------------------------------------------

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None:
        """On the home node (the authority; it must succeed), then on every other live
        node, where pops run. A node that misses it gets it before its next pop."""
        home = await self.home_for_write(namespace)
        await self.with_namespace(
            home, namespace, lambda c: c.set_group_config(namespace, group, config)
        )
        home.synced_groups.setdefault(namespace, set()).add(group)
        others = [n for n in self._router.cache.live_nodes() if n is not home]
        results = await asyncio.gather(
            *(
                self.with_namespace(
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

    async def sync_group(self, node: Node, namespace: str, group: str) -> None:
        """Give ``node`` the group's config from the home node before it pops for the
        group (it may have been down, or not yet in the pool, when it was set)."""
        try:
            home = self._router.cache.homes.get(namespace)
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
