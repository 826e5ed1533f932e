"""A vhost's change log: how the gateways over one storage keep one picture of it.

Every change of a definition (exchange, queue, binding) or of the consumers of a queue
is appended, after it is persisted as metadata, to an internal storage topic of the
namespace that every gateway serving the vhost tails with a long-poll read. So a
gateway routes publishes from its own cache, without a storage round trip per
message, and still learns of another gateway's declare within a read's latency.

Ordering: the log is one storage queue, so every gateway applies changes in one
order (their offsets); the offset of a consumer's registration is its place in line
for single-active-consumer. A change's maker returns to its client only after every
live peer (:class:`Membership`) that tails the vhost (a tail position stamped within
:data:`_STALE_MS`; one that does not will read the metadata when it loads the vhost)
has committed, as its tail position, an offset past the change, or after
:data:`BARRIER_TIMEOUT_S`: so a declare-ok, bind-ok or delete-ok
means every live gateway routes with it (RabbitMQ's promise), unless a peer lags that
long (it then catches up on its own). A peer applies a new queue only once its storage
client finds the queue's topic (the separated form's routes follow topic creation a
moment later), so "has it" includes "can reach it".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from polymq.gateway.processor import Caller, Processor
from polymq.navigation.endpoints import GatewayDirectory, owner_of
from polymq.storage.errors import OffsetOutOfRange, StorageError, TopicAlreadyExists, TopicNotFound
from polymq.storage.model import AppendRequest, CommittedOffset, Message, QueueRef, TopicConfig

__all__ = [
    "BARRIER_TIMEOUT_S",
    "CHANGES_TOPIC",
    "LOG_PROTOCOL",
    "Change",
    "ChangeLog",
    "Membership",
]

log = logging.getLogger(__name__)

CHANGES_TOPIC: Final = "%AMQP%changes"
LOG_PROTOCOL: Final = "amqp.changes"  # the metering protocol of the log's own traffic
_TAIL_GROUP: Final = "%AMQP%tail."  # + gateway id: how far that gateway has applied
_RETENTION_MS: Final = 7 * 24 * 3600 * 1000
_TAIL_WAIT_MS: Final = 5_000
_TAIL_BATCH: Final = 256
BARRIER_TIMEOUT_S: Final = 2.0
_RETRY_S: Final = 0.5
_OPEN_ATTEMPTS: Final = 100
_STALE_MS: Final = 3 * _TAIL_WAIT_MS


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One definition's new state: ``value`` ``None`` when it was deleted. ``kind`` is
    exchange, queue, binding, consumer or used (a queue's ``x-expires`` clock reset).
    ``origin``: the gateway instance that made it (it applied it already)."""

    kind: str
    name: str
    value: dict[str, Any] | None
    origin: str

    def encode(self) -> bytes:
        return json.dumps(
            {"kind": self.kind, "name": self.name, "value": self.value, "origin": self.origin}
        ).encode()

    @staticmethod
    def decode(body: bytes) -> Change | None:
        try:
            raw = json.loads(body)
            return Change(
                kind=str(raw["kind"]),
                name=str(raw["name"]),
                value=raw["value"],
                origin=str(raw["origin"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


class Membership:
    """This gateway instance among the live gateways serving a protocol (from the
    gateway directory). An instance is the gateway's id plus a token drawn at start:
    what a gateway's previous run left (its exclusive queues, its consumers) is told
    apart from what it owns now."""

    def __init__(self, directory: GatewayDirectory, protocol: str, gateway_id: str) -> None:
        self._directory = directory
        self._protocol = protocol
        self.gateway_id = gateway_id
        self.instance = f"{gateway_id}#{secrets.token_hex(6)}"

    def live(self) -> set[str]:
        return {e.gateway_id for e in self._directory.endpoints(self._protocol)} | {self.gateway_id}

    def peers(self) -> list[str]:
        return sorted(self.live() - {self.gateway_id})

    def is_live(self, instance: str) -> bool:
        """Whether ``instance`` (or a gateway id) still serves: ours must be this run."""
        gateway_id = instance.partition("#")[0]
        if gateway_id == self.gateway_id:
            return instance in (self.instance, gateway_id)
        return gateway_id in self.live()

    def is_owner(self, key: str) -> bool:
        """Whether this gateway does the shared chores of ``key`` (a queue's expiry):
        one gateway per key, by rendezvous hash over the live ones."""
        endpoints: Sequence[Any] = self._directory.endpoints(self._protocol)
        owner = owner_of(key, endpoints)
        return owner is None or owner.gateway_id == self.gateway_id or len(endpoints) < 2


class ChangeLog:
    """The log of one namespace: append, tail (applying others' changes with
    ``apply(change, offset)``) and wait for the live peers."""

    def __init__(
        self,
        processor: Processor,
        caller: Caller,
        membership: Membership,
        apply: Callable[[Change, int], Awaitable[None]],
    ) -> None:
        self._processor = processor
        # Metered apart from AMQP's own traffic (the processor meters every append).
        self._caller = dataclasses.replace(caller, protocol=LOG_PROTOCOL)
        self._membership = membership
        self._apply = apply
        self._ref = QueueRef(caller.namespace, CHANGES_TOPIC, 0)
        self._tailer: asyncio.Task[None] | None = None
        self.applied = 0  # the next offset to read

    async def open(self) -> int:
        """Make sure the log exists; returns its end, where tailing starts (taken
        before the definitions are read, so no change falls in between)."""
        config = TopicConfig(queue_count=1, retention_ms=_RETENTION_MS, internal=True)
        for attempt in range(_OPEN_ATTEMPTS):
            with contextlib.suppress(TopicAlreadyExists):
                await self._processor.create_topic(self._caller, CHANGES_TOPIC, config)
            try:
                bounds = await self._processor.queue_offsets(self._caller, self._ref)
                return bounds.latest
            except TopicNotFound:
                # Made by another gateway a moment ago: the separated form's routes
                # to it may lag behind "already exists".
                if attempt == _OPEN_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.05)
        raise AssertionError("unreachable")

    async def start(self, offset: int) -> None:
        """Tail from ``offset``; the position is committed at once, so a peer's
        change from now on waits for this gateway."""
        self.applied = offset
        await self._commit()
        self._tailer = asyncio.create_task(self._tail(), name="amqp-changes-tail")

    async def _commit(self) -> None:
        """Commit the tail position, stamped with the time and this instance: a peer
        waits only for gateways whose stamp is recent (those tailing this vhost now),
        and knows a gateway restarted under the same id by its instance."""
        stamp = f"{self._processor.clock.now_ms()} {self._membership.instance}"
        await self._processor.commit_offset(
            self._caller, _TAIL_GROUP + self._membership.gateway_id, self._ref, self.applied, stamp
        )

    async def tailing_instance(self, gateway_id: str) -> str | None:
        """The instance of ``gateway_id`` that tails this vhost now (``None``: none
        does, stamped within :data:`_STALE_MS`). A gateway with consumers in a vhost
        tails it, so one that does not is gone, or restarted and not here yet."""
        committed = await self._processor.fetch_offset(
            self._caller, _TAIL_GROUP + gateway_id, self._ref
        )
        if committed is None or not self._tailing(committed):
            return None
        return committed.metadata.partition(" ")[2] or None

    async def close(self) -> None:
        if self._tailer is not None:
            self._tailer.cancel()
            await asyncio.gather(self._tailer, return_exceptions=True)

    async def append(self, change: Change) -> int:
        """Append a change (already persisted and applied here); returns its offset."""
        [result] = await self._processor.append(
            self._caller,
            [AppendRequest(entry=Message(body=change.encode()), queues=(self._ref,))],
        )
        return max((p.offset for p in result.placements), default=0)

    async def barrier(self, offset: int) -> None:
        """Return once every live peer has applied the change at ``offset`` (or after
        :data:`BARRIER_TIMEOUT_S`: a peer that slow, or dead, catches up by itself)."""
        waiting = self._membership.peers()
        if not waiting:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BARRIER_TIMEOUT_S
        pause = 0.001
        while waiting:
            behind: list[str] = []
            for peer in waiting:
                try:
                    committed = await self._processor.fetch_offset(
                        self._caller, _TAIL_GROUP + peer, self._ref
                    )
                except StorageError:
                    committed = None
                if (
                    committed is not None
                    and committed.offset <= offset
                    and self._tailing(committed)
                ):
                    behind.append(peer)
            waiting = [p for p in behind if p in self._membership.peers()]
            if not waiting:
                return
            if loop.time() >= deadline:
                log.warning("amqp: gateways %s did not apply change %d in time", waiting, offset)
                return
            await asyncio.sleep(pause)
            pause = min(0.02, pause * 2)

    def _tailing(self, committed: CommittedOffset) -> bool:
        """Whether a peer's tail position is live: stamped within :data:`_STALE_MS`
        (a gateway that never served the vhost, or is gone, has none or an old one)."""
        try:
            stamp = int(committed.metadata.partition(" ")[0])
        except ValueError:
            return False
        return self._processor.clock.now_ms() - stamp < _STALE_MS

    async def _tail(self) -> None:
        processor, caller, ref = self._processor, self._caller, self._ref
        own = self._membership.instance
        stamped = processor.clock.now_ms()
        while True:
            try:
                result = await processor.read(
                    caller,
                    ref,
                    self.applied,
                    max_messages=_TAIL_BATCH,
                    wait_ms=_TAIL_WAIT_MS,
                    metered=False,
                )
            except OffsetOutOfRange as e:  # retention passed us by: go on from the start
                log.warning("amqp: change log of %s skipped ahead: %s", caller.namespace, e)
                self.applied = (await processor.queue_offsets(caller, ref)).earliest
                continue
            except (TopicNotFound, StorageError) as e:
                log.debug("amqp: tailing the change log failed: %s", e)
                await asyncio.sleep(_RETRY_S)
                continue
            for stored in result.messages:
                change = Change.decode(stored.message.body)
                if change is not None and change.origin != own:
                    try:
                        await self._apply(change, stored.offset)
                    except Exception:
                        log.exception("amqp: applying change %d failed", stored.offset)
            now = processor.clock.now_ms()
            if result.next_offset != self.applied or now - stamped >= _TAIL_WAIT_MS:
                self.applied = result.next_offset
                stamped = now
                try:
                    await self._commit()
                except StorageError as e:
                    log.debug("amqp: committing the tail position failed: %s", e)
