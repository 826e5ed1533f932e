"""Pops and acks over queues held by several storage nodes.

Each node's engine hands out only its own queues' messages, so a pop whose queues
span nodes asks them in turn: without waiting first (node after node, each asked only
for what is still missing, so nothing is handed out beyond ``max_messages``); then, if
all were empty and the caller may wait, a waiting pop on every node at once. The first
non-empty answer wins and the others are cancelled (a node's pop gives back what it
handed out when cancelled). A node may still answer in the instant before its cancel
lands: those messages are handed out already, so they are kept in an
:class:`Overflow` for the group and handed out first by the next pop. (That needs the
node client to return such an answer rather than drop it: an in-process engine does;
today's RPC client drops an answer that arrives after its call was cancelled, and
those messages come back when their invisibility ends.)

Acks find their node by the receipt's ``<node_id>:`` prefix; a batch of receipts from
several nodes is sent as one call per node, at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from polymq.storage.cluster_routes import Node, NodeClient, RouteCache
from polymq.storage.errors import InvalidReceipt, StorageUnavailable
from polymq.storage.model import QueueRef, StoredMessage

__all__ = ["Overflow", "PopAsk", "ack_spread", "pop_spread", "with_prefix"]

_INVALID_RECEIPT = InvalidReceipt.code
_UNAVAILABLE = StorageUnavailable.code


def with_prefix(messages: list[StoredMessage], prefix: str) -> list[StoredMessage]:
    """Prefix each receipt with the node's id, so acks find their way back.

    The messages are fresh objects of this call (decoded from the node's answer, or
    built by an in-process engine for this pop), not shared with anyone: the receipt
    is set in place instead of copying every message (a copy of a frozen dataclass
    costs ten times as much as the pop's own bookkeeping per message)."""
    for message in messages:
        if message.receipt is not None:
            object.__setattr__(message, "receipt", prefix + message.receipt)
    return messages


@dataclass(frozen=True, slots=True)
class PopAsk:
    """One pop's arguments, as the cluster client passes them on to the nodes."""

    namespace: str
    group: str
    max_messages: int
    invisible_ms: int
    wait_ms: int
    tags: frozenset[str] | None
    durable: bool

    async def send(
        self,
        client: NodeClient,
        queues: Sequence[QueueRef],
        *,
        max_messages: int | None = None,
        wait_ms: int | None = None,
    ) -> list[StoredMessage]:
        """This pop on one node, over its ``queues`` (``max_messages`` and ``wait_ms``
        overridden where given)."""
        return await client.pop(
            self.namespace,
            self.group,
            queues,
            max_messages=self.max_messages if max_messages is None else max_messages,
            invisible_ms=self.invisible_ms,
            wait_ms=self.wait_ms if wait_ms is None else wait_ms,
            tags=self.tags,
            durable=self.durable,
        )


class Overflow:
    """Messages handed out to a group by a node beyond what a pop could return.

    Per (namespace, group). A message is handed out again only to a pop of the same
    group that names its queue and accepts its tag, and only while it is still
    invisible (past that, the node redelivers it and its receipt is stale)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], list[StoredMessage]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def keep(self, namespace: str, group: str, messages: Sequence[StoredMessage]) -> None:
        if messages:
            self._held.setdefault((namespace, group), []).extend(messages)

    def take(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        tags: frozenset[str] | None,
        max_messages: int,
        now_ms: int,
    ) -> list[StoredMessage]:
        held = self._held.get((namespace, group))
        if not held:
            return []
        wanted = set(queues)
        any_tag = tags is None or "*" in tags
        taken: list[StoredMessage] = []
        kept: list[StoredMessage] = []
        for message in held:
            if message.next_visible_ms is not None and message.next_visible_ms <= now_ms:
                continue  # visible again on its node: this hand-out is over
            if (
                len(taken) < max_messages
                and message.queue in wanted
                and (any_tag or (tags is not None and message.message.tag in tags))
            ):
                taken.append(message)
            else:
                kept.append(message)
        if kept:
            self._held[(namespace, group)] = kept
        else:
            del self._held[(namespace, group)]
        return taken

    def drain(self) -> list[tuple[str, str, list[StoredMessage]]]:
        """Everything held (to give back on close)."""
        held = [(ns, group, messages) for (ns, group), messages in self._held.items()]
        self._held.clear()
        return held


async def pop_spread(
    parts: Sequence[tuple[Node, list[QueueRef]]],
    ask: PopAsk,
    *,
    overflow: Overflow,
    rotation: int,
) -> list[StoredMessage]:
    """Pop from queues on several nodes (``parts``: each node with its queues).

    A node that is down is skipped while others serve; only when every node is down
    does the pop raise :class:`StorageUnavailable`. ``rotation`` picks the node asked
    first, so a busy first node does not starve the others."""
    errors: list[StorageUnavailable] = []
    got: list[StoredMessage] = []
    start = rotation % len(parts)
    serving: list[tuple[Node, list[QueueRef]]] = []
    for node, queues in (*parts[start:], *parts[:start]):
        if len(got) >= ask.max_messages:
            serving.append((node, queues))
            continue
        if not node.alive:
            errors.append(node.down())
            continue
        try:
            popped = await ask.send(
                node.client, queues, max_messages=ask.max_messages - len(got), wait_ms=0
            )
        except StorageUnavailable as exc:
            errors.append(node.unreachable(exc))
            continue
        got += with_prefix(popped, node.prefix)
        serving.append((node, queues))
    if got:
        return got
    if not serving:
        raise errors[0]
    if ask.wait_ms <= 0:
        return []
    return await _wait_first(serving, ask, overflow)


async def _wait_first(
    parts: Sequence[tuple[Node, list[QueueRef]]], ask: PopAsk, overflow: Overflow
) -> list[StoredMessage]:
    """Waiting pops on every node at once; the first non-empty answer wins."""
    loop = asyncio.get_running_loop()
    tasks = {loop.create_task(ask.send(node.client, queues)): node for node, queues in parts}
    got: list[StoredMessage] = []
    errors: list[StorageUnavailable] = []
    failure: BaseException | None = None
    pending: set[asyncio.Task[list[StoredMessage]]] = set(tasks)
    try:
        while pending and not got and failure is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                node = tasks[task]
                exc = task.exception()
                if exc is None:
                    got += with_prefix(task.result(), node.prefix)
                elif isinstance(exc, StorageUnavailable):
                    errors.append(node.unreachable(exc))
                elif failure is None:
                    failure = exc
    finally:
        await _settle(pending, tasks, overflow, ask.namespace, ask.group)
        if failure is not None:
            overflow.keep(ask.namespace, ask.group, got)
    if failure is not None:
        raise failure
    if not got and errors and len(errors) == len(tasks):
        raise errors[0]
    if len(got) > ask.max_messages:
        overflow.keep(ask.namespace, ask.group, got[ask.max_messages :])
        del got[ask.max_messages :]
    return got


async def _settle(
    pending: set[asyncio.Task[list[StoredMessage]]],
    nodes: dict[asyncio.Task[list[StoredMessage]], Node],
    overflow: Overflow,
    namespace: str,
    group: str,
) -> None:
    """Cancel the pops still out and wait for the cancels to land; what a node handed
    out in the instant before its cancel arrived (it answered first) goes to the
    overflow, even if this wait is cancelled itself."""
    for task in pending:
        task.cancel()
    try:
        if pending:
            await asyncio.wait(pending)
    finally:
        late: list[StoredMessage] = []
        for task in pending:
            if task.done() and not task.cancelled() and task.exception() is None:
                late += with_prefix(task.result(), nodes[task].prefix)
        overflow.keep(namespace, group, late)


async def ack_spread(
    routes: RouteCache,
    namespace: str,
    group: str,
    receipts: Sequence[str],
    *,
    durable: bool = True,
) -> list[str | None]:
    """Ack receipts of several nodes: per node, one call each, at once. A receipt of a
    node that is down gets ``storage_unavailable`` (its message comes back after its
    invisibility)."""
    outcomes: list[str | None] = [None] * len(receipts)
    split: dict[Node, list[int]] = {}
    for i, receipt in enumerate(receipts):
        cut = receipt.find(":")
        node = routes.nodes.get(receipt[:cut]) if cut > 0 else None
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
                namespace, group, [receipts[i][len(n.prefix) :] for i in split[n]], durable=durable
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
