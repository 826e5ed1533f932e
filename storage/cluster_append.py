"""Appends whose queues are on several storage nodes.

Topics are placed whole, but one append may name queues of several topics (an AMQP
fanout, an MQTT publish routed to many sessions, an MNS topic's subscriber queues). Each
node then stores its own copy of the entry for its queues, one call per node for all
its shares, at once; every copy carries one message id assigned here, so each protocol
reports the same id whichever copy it reads, and ``cancel_delayed`` with that id
reaches them all.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence

from polymq.storage.api import check_append_queues
from polymq.storage.clock import Clock
from polymq.storage.cluster_router import Router
from polymq.storage.cluster_routes import Node
from polymq.storage.engine.ids import MessageIds
from polymq.storage.errors import StorageUnavailable
from polymq.storage.model import AppendRequest, AppendResult, QueueRef

__all__ = ["SpreadAppends", "merge"]


class SpreadAppends:
    """Splits appends per node and merges the nodes' results back per request."""

    def __init__(self, router: Router, clock: Clock) -> None:
        self._router = router
        self._clock = clock
        # This client's own random node id, in the engine's RocketMQ-shaped format.
        self._ids = MessageIds(secrets.token_bytes(6))

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        """Each request split per node (same entry, same dedup key), one append call
        per node for all its shares, at once; results merged back per request."""
        shares: dict[Node, list[AppendRequest]] = {}
        # Per request: (node, index of its share in that node's call), first queue's first.
        where: list[list[tuple[Node, int]]] = []
        for request in requests:
            check_append_queues(request)
            split: dict[Node, list[QueueRef]] = {}
            for queue in request.queues:
                node = await self._router.locate(queue.namespace, queue.topic)
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
                        durable=request.durable,
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
            merge(request, [by_node[node][i] for node, i in places])
            for request, places in zip(requests, where, strict=True)
        ]


def merge(request: AppendRequest, parts: list[AppendResult]) -> AppendResult:
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
