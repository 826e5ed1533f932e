"""What transaction coordinators decide, kept in storage so every gateway reads it.

With several gateways the coordinator of a transactional id (which sees
AddPartitionsToTxn and EndTxn) is often not the leader of its partitions (which serves
Produce and Fetch); in the separated form they are different processes. So the
coordinator writes, as storage metadata of the namespace:

* per partition (kind ``kafka.txn.<topic hash>.<partition>``), ``open:<producer id>``
  while a transaction may have records there, holding the partition's end offset when
  the partition joined it (no record of the transaction can be below: clients send
  AddPartitionsToTxn before producing), and ``abort:<marker offset>`` for each aborted
  transaction, holding ``[producer id, first offset]``;
* per transactional id (kind ``kafka.txn_state``), the producer and the partitions of
  its open transaction, so a coordinator that did not see it begin (a restart, another
  gateway taking the id over when the gateway list changed) can carry it on, or abort
  it at InitProducerId.

A partition's entries are in one kind, so one ``meta_list`` reads them all. EndTxn
writes an aborted range before it removes the open entry, so a reader never sees an
aborted transaction as neither open nor aborted (that would read as committed). Fetch
reads the entries only when the records it read hold transactional batches, so topics
without transactions cost nothing more.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from polymq.protocols.kafka.session import Session
from polymq.protocols.kafka.transactions import AbortedRange, Transaction
from polymq.storage.model import QueueRef

__all__ = [
    "PartitionTransactions",
    "forget_transaction",
    "join_partitions",
    "partition_transactions",
    "save_transaction",
    "settle_partition",
    "stored_transaction",
]

_STATE_KIND = "kafka.txn_state"
_OPEN = "open:"
_ABORT = "abort:"


def _kind(queue: QueueRef) -> str:
    # Hashed: kinds are names of at most 255 bytes, topics reach 249.
    topic = hashlib.blake2b(queue.topic.encode(), digest_size=8).hexdigest()
    return f"kafka.txn.{topic}.{queue.queue_id}"


@dataclass(frozen=True, slots=True)
class PartitionTransactions:
    """One partition's transactions as the coordinators left them."""

    open: dict[int, int] = field(default_factory=dict)  # producer id -> first offset
    aborted: tuple[AbortedRange, ...] = ()

    def last_stable(self, high_watermark: int) -> int:
        return min([*self.open.values(), high_watermark])

    def aborted_in(self, start: int, end: int) -> list[AbortedRange]:
        """Aborted ranges overlapping offsets [start, end)."""
        return [r for r in self.aborted if r.last_offset >= start and r.first_offset < end]


async def partition_transactions(session: Session, queue: QueueRef) -> PartitionTransactions:
    entries = await session.processor.meta_list(session.caller, _kind(queue))
    opened: dict[int, int] = {}
    aborted = []
    for name, value in entries.items():
        if name.startswith(_OPEN):
            opened[int(name.removeprefix(_OPEN))] = int(value)
        elif name.startswith(_ABORT):
            producer_id, first = value
            aborted.append(
                AbortedRange(int(producer_id), int(first), int(name.removeprefix(_ABORT)))
            )
    aborted.sort(key=lambda r: r.first_offset)
    return PartitionTransactions(opened, tuple(aborted))


async def join_partitions(session: Session, txn: Transaction, queues: Iterable[QueueRef]) -> None:
    """Open ``txn`` on partitions new to it (AddPartitionsToTxn), before its producer
    may write there."""
    new = sorted({q for q in queues if q not in txn.first_offsets}, key=str)
    if not new:
        return

    async def join(queue: QueueRef) -> None:
        offsets = await session.processor.queue_offsets(session.caller, queue)
        await session.processor.meta_put(
            session.caller, _kind(queue), f"{_OPEN}{txn.producer_id}", offsets.latest
        )
        txn.first_offsets[queue] = offsets.latest

    await asyncio.gather(*(join(q) for q in new))
    await save_transaction(session, txn)


async def settle_partition(
    session: Session, txn: Transaction, queue: QueueRef, marker_offset: int, *, commit: bool
) -> None:
    """The marker is written: record an abort's range, then close the partition."""
    kind = _kind(queue)
    first = txn.first_offsets.get(queue)
    if not commit and first is not None and marker_offset >= 0:
        await session.processor.meta_put(
            session.caller, kind, f"{_ABORT}{marker_offset:020d}", [txn.producer_id, first]
        )
    await session.processor.meta_delete(session.caller, kind, f"{_OPEN}{txn.producer_id}")


async def forget_transaction(session: Session, txn: Transaction) -> None:
    txn.first_offsets.clear()
    await session.processor.meta_delete(session.caller, _STATE_KIND, txn.transactional_id)


async def stored_transaction(session: Session, transactional_id: str) -> Transaction | None:
    """A transactional id's producer and open transaction, as its coordinator stored
    them."""
    state = await session.processor.meta_get(session.caller, _STATE_KIND, transactional_id)
    if not state:
        return None
    txn = Transaction(transactional_id, int(state["producer_id"]), int(state["epoch"]))
    for topic, partition, first in state["partitions"]:
        queue = QueueRef(session.namespace, topic, int(partition))
        txn.partitions.add(queue)
        txn.first_offsets[queue] = int(first)
    return txn


async def save_transaction(session: Session, txn: Transaction) -> None:
    """Store ``txn``'s producer and partitions (InitProducerId, AddPartitionsToTxn)."""
    state = {
        "producer_id": txn.producer_id,
        "epoch": txn.epoch,
        "partitions": [[q.topic, q.queue_id, first] for q, first in txn.first_offsets.items()],
    }
    await session.processor.meta_put(session.caller, _STATE_KIND, txn.transactional_id, state)
