"""A connection's publishes stored in order behind its reading.

A QoS 1 PUBACK waits for the fsync, but the PUBLISHes after it need not: online
subscribers get each one from memory as it is read (routing.py), and only its
append and its ack wait. Reading stopped while a batch was stored, so one slow
fsync (this disk stalls 15-100 ms now and then) held up every later message of the
connection, the ones delivered from memory too. Instead the connection routes each
batch as it reads it and queues the batch; one task stores what is queued, all of
it with one call (one append, one group commit), and hands each batch's outcome
back in order, so acks go out in publish order (3.1.1 4.6).

Bounded: past ``limit_bytes`` queued, the connection stops reading until the queue
is empty, as it did for every batch before.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.routing import Routed
from polymq.storage.errors import InvalidName, MessageTooLarge, StorageError

if TYPE_CHECKING:
    from polymq.protocols.mqtt.broker import MqttBroker

__all__ = ["PublishBatch", "StoreOutcome", "StoreQueue", "store_batches"]

log = logging.getLogger(__name__)

Batch = TypeVar("Batch")
Outcome = TypeVar("Outcome")


class StoreQueue(Generic[Batch, Outcome]):
    """``store`` stores batches in order, together, and returns one outcome each;
    ``done(batch, outcome)`` then runs for each in order and says whether to go on.
    Once it says no (the connection is closing), what is queued is dropped:
    neither stored nor acknowledged, as if it had not been read."""

    def __init__(
        self,
        store: Callable[[list[Batch]], Awaitable[list[Outcome]]],
        done: Callable[[Batch, Outcome], bool],
        *,
        limit_bytes: int,
    ) -> None:
        self._store = store
        self._done = done
        self._limit = limit_bytes
        self._queued: deque[tuple[Batch, int]] = deque()
        self._bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._ended = False

    def __len__(self) -> int:
        return len(self._queued) + (self._task is not None)

    def put(self, batch: Batch, nbytes: int) -> None:
        if self._ended:
            return
        self._queued.append((batch, nbytes))
        self._bytes += nbytes
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def ended(self) -> bool:
        return self._ended

    def full(self) -> bool:
        return self._bytes > self._limit

    async def drain(self) -> None:
        """Wait until everything queued was stored and reported, or dropped. A
        cancelled waiter leaves the store running (its batches still get stored)."""
        while self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        try:
            while self._queued and not self._ended:
                batches = [batch for batch, _ in self._queued]
                self._queued.clear()
                self._bytes = 0
                outcomes = await self._store(batches)
                for batch, outcome in zip(batches, outcomes, strict=True):
                    if not self._done(batch, outcome):
                        self._ended = True
                        break
        except Exception:
            log.exception("storing queued publishes failed")
            self._ended = True
        finally:
            self._task = None
            if self._ended:
                self._queued.clear()
                self._bytes = 0


@dataclass(slots=True)
class PublishBatch:
    """A run of PUBLISHes read together: their acks (in order; ``item_acks`` maps a
    routed item to its ack), what routing made of them, or why that failed."""

    acks: list[codec.Packet]
    item_acks: dict[int, int]
    qos_count: int  # QoS 1/2 PUBLISHes among them (v5 receive maximum)
    routed: Routed | None = None
    error: StorageError | None = None


# A batch's outcome: its items not stored (by index), or the error that failed it.
StoreOutcome = dict[int, StorageError] | StorageError


async def store_batches(broker: MqttBroker, batches: list[PublishBatch]) -> list[StoreOutcome]:
    """Store routed batches in order with one append; each batch's outcome."""
    routed = [b.routed for b in batches if b.routed is not None]
    try:
        unstored = await broker.store(Routed.join(routed)) if routed else {}
    except (MessageTooLarge, InvalidName) as e:
        if len(routed) == 1:
            return [b.error or (e if b.routed is not None else {}) for b in batches]
        # One batch's fault: each alone again (storage checks every request of an
        # append before it stores any of them).
        return [(await store_batches(broker, [b]))[0] for b in batches]
    except StorageError as e:
        return [b.error or (e if b.routed is not None else {}) for b in batches]
    outcomes: list[StoreOutcome] = []
    start = 0
    for b in batches:
        if b.routed is None:
            outcomes.append(b.error or {})
            continue
        end = start + len(b.routed.items)
        outcomes.append({i - start: e for i, e in unstored.items() if start <= i < end})
        start = end
    return outcomes
