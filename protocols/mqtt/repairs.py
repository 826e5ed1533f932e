"""Copies a publish owes to session and shared queues that were unavailable.

A publish is acknowledged once it is stored in its own storage topic. When the queue
of a persistent session (or shared group) it reaches is on a storage node that is
down, the publish is stored in its topic alone, with the names of the queues it still
owes a copy to in its last property (``mqtt.owed``), so a dead node fails only what
needs it (issue 22). The topic's tail reads it back like any message; this module
makes the copies, retried until their node answers, in order per queue, and holds
the tail's committed position below every owed message whose copies are not all
made, so a gateway that dies meanwhile leaves them to its successor's tail (which
makes them again: QoS 1 allows the duplicate). docs/mqtt.md, "A storage node down".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import deque
from dataclasses import dataclass, field, replace

from polymq.protocols.mqtt.core import BrokerCore
from polymq.storage.errors import (
    QueueNotFound,
    StorageClosed,
    StorageError,
    StorageFailed,
    StorageUnavailable,
    TopicNotFound,
)
from polymq.storage.model import AppendRequest, Message, QueueRef

__all__ = ["MQTT_OWED", "Repairs", "owed_targets", "owing", "without_owed"]

log = logging.getLogger(__name__)

MQTT_OWED = "mqtt.owed"  # private (interop.PRIVATE_PREFIXES): no consumer sees it
_RETRY_S = 1.0
_BATCH = 256  # copies per append into one queue


def owing(message: Message, targets: list[str]) -> Message:
    """``message`` marked as owing copies to the queues named ``targets`` (last
    property, so a tail finds it without a scan)."""
    value = "\n".join(targets).encode()
    return replace(message, properties=(*message.properties, (MQTT_OWED, value)))


def owed_targets(message: Message) -> list[str]:
    """The queues a stored publish owes a copy to (none for most messages)."""
    properties = message.properties
    if not properties or properties[-1][0] != MQTT_OWED:
        return []
    return properties[-1][1].decode("utf-8", "replace").split("\n")


def without_owed(message: Message) -> Message:
    """A marked publish as the queues it owes get it."""
    return replace(message, properties=message.properties[:-1])


def copy_key(target: str, origin: QueueRef, offset: int) -> str:
    """The dedup key of the copy into queue ``target`` of what is stored at ``origin``
    and ``offset``: whoever makes it first (publisher or tail), storage keeps one. A
    digest, as queue names alone may fill a key's 255 bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (target, origin.topic, str(origin.queue_id), str(offset)):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return f"{MQTT_OWED}:{digest.hexdigest()}"


@dataclass(eq=False)
class _Owed:
    source: QueueRef | None  # where the message is stored (None: not known)
    offset: int
    message: Message  # as the queues get it
    left: set[str] = field(default_factory=set)  # queues not yet given their copy
    held: bool = True  # a tail read it: the tail's position waits for the copies


class Repairs:
    """The owed copies of one namespace's broker: a queue per target, each with one
    task that appends them in order while its node is away."""

    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        self._by_target: dict[str, deque[_Owed]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Per source queue, the owed messages a tail read, not fully copied.
        self._by_source: dict[QueueRef, dict[int, _Owed]] = {}
        # The owed messages this gateway published and no tail here read yet.
        self._published: dict[tuple[QueueRef, int], _Owed] = {}
        self._suspects: set[str] = set()  # queues of a failed append (suspect)
        self._prober: asyncio.Task[None] | None = None

    def busy(self, target: str) -> bool:
        """Whether copies are still owed to that queue, or it was in a failed append
        and has not answered since: a publish reaching it is stored owing too, so
        the copies reach it in publish order, and no append that spans its node is
        tried while the node may be away (one would write the shares of the live
        nodes, and the publish stored again owing would be there twice)."""
        return target in self._by_target or target in self._suspects

    @property
    def idle(self) -> bool:
        """No queue owed copies nor suspect: no publish needs :meth:`busy` asked."""
        return not self._by_target and not self._suspects

    def suspect(self, targets: list[str]) -> None:
        """Queues of a failed append (one of them is on a node that is away): until
        each answers again (a look at its offsets, every second), publishes reaching
        it are stored owing."""
        new = [t for t in targets if t not in self._suspects]
        self._suspects.update(new)
        if new and (self._prober is None or self._prober.done()):
            self._prober = self.core.tasks.spawn(self._probe())

    async def _probe(self) -> None:
        while self._suspects:
            await asyncio.sleep(_RETRY_S)
            suspects = list(self._suspects)
            for start in range(0, len(suspects), _BATCH):
                chunk = suspects[start : start + _BATCH]
                answers = await asyncio.gather(*(self._answers(t) for t in chunk))
                answered = [t for t, ok in zip(chunk, answers, strict=True) if ok]
                self._suspects.difference_update(answered)

    async def _answers(self, target: str) -> bool:
        queue = QueueRef(self.core.namespace, target, 0)
        try:
            await self.core.processor.queue_offsets(self.core.caller, queue)
        except (StorageUnavailable, StorageFailed, StorageClosed):
            return False
        except StorageError:
            return True  # gone, or not known yet: the copies' own retries decide
        return True

    def owe(
        self,
        source: QueueRef | None,
        offset: int,
        message: Message,
        targets: list[str],
        *,
        held: bool = True,
    ) -> None:
        """Copies of ``message`` to make into the queues named ``targets``, of what is
        stored in ``source`` at ``offset``: read there by a tail (``held``: its
        position waits until they are made), or just stored there by this gateway's
        publish (not ``held``: the topic owner's tail makes them too). ``source``
        None: a message no tail will read again, made from memory only."""
        if source is not None:
            if offset in self._by_source.get(source, {}):
                return  # read again (the tail started over): already owed
            published = self._published.get((source, offset))
            if published is not None:
                if held:  # this gateway's tail reached its own publish: one entry
                    del self._published[source, offset]
                    published.held = True
                    self._by_source.setdefault(source, {})[offset] = published
                return
        owed = _Owed(source, offset, message, set(targets), held)
        if source is not None:
            if held:
                self._by_source.setdefault(source, {})[offset] = owed
            else:
                self._published[source, offset] = owed
        for target in targets:
            self._by_target.setdefault(target, deque()).append(owed)
            task = self._tasks.get(target)
            if task is None or task.done():
                self._tasks[target] = self.core.tasks.spawn(self._copy(target))

    def hold(self, source: QueueRef) -> int | None:
        """The lowest offset of ``source`` whose copies are not all made: a tail
        commits no further."""
        pending = self._by_source.get(source)
        return min(pending) if pending else None  # read again after a restart: any order

    async def _copy(self, target: str) -> None:
        queue = QueueRef(self.core.namespace, target, 0)
        pending = self._by_target[target]
        while pending:
            batch = [pending[i] for i in range(min(_BATCH, len(pending)))]
            requests = [
                AppendRequest(
                    entry=owed.message,
                    queues=(queue,),
                    dedup_key=(
                        None if owed.source is None else copy_key(target, owed.source, owed.offset)
                    ),
                )
                for owed in batch
            ]
            try:  # copies of what was metered when it was published
                await self.core.processor.append(self.core.caller, requests, metered=False)
            except (TopicNotFound, QueueNotFound):
                if self._wanted(target):  # a route not known yet: retry
                    await asyncio.sleep(_RETRY_S)
                    continue
                log.info("mqtt: %d copies owed to %s dropped: it is gone", len(pending), target)
                batch = list(pending)
            except (StorageUnavailable, StorageFailed, StorageClosed) as e:  # node away
                log.debug("mqtt: copies owed to %s wait: %s", target, e)
                await asyncio.sleep(_RETRY_S)
                continue
            except StorageError as e:  # no retry would store them
                log.warning("mqtt: %d copies owed to %s dropped: %s", len(batch), target, e)
            else:
                self._wake(target)
            for owed in batch:
                pending.popleft()
                self._done(owed, target)
        del self._by_target[target]

    def _done(self, owed: _Owed, target: str) -> None:
        owed.left.discard(target)
        if owed.left or owed.source is None:
            return
        if not owed.held:
            self._published.pop((owed.source, owed.offset), None)
            return
        pending = self._by_source.get(owed.source)
        if pending is not None:
            pending.pop(owed.offset, None)
            if not pending:
                del self._by_source[owed.source]

    def _wanted(self, target: str) -> bool:
        """Whether some session or shared group still has that queue."""
        core = self.core
        return any(
            s.queue is not None and s.queue.topic == target for s in core.sessions.values()
        ) or any(g.queue.topic == target for g in core.shared.values())

    def _wake(self, target: str) -> None:
        for session in self.core.sessions.values():
            if session.owner is not None and session.queue and session.queue.topic == target:
                session.owner.wake()
        for group in self.core.shared.values():
            if group.queue.topic == target:
                owner = group.next_owner()
                if owner is not None:
                    owner.wake()

    async def close(self) -> None:
        """Stop copying (server stop): what is left is held in the tails' positions."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
