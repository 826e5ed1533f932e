"""Kafka transactions (KIP-98), kept in this gateway's memory.

Transactional records are stored at once, as Kafka stores them; what makes them
transactional is bookkeeping around them:

* per partition, the first offset of each open transaction: the last stable offset
  (LSO) is the smallest of them, and read_committed fetches stop there;
* at EndTxn, a control batch (commit or abort marker) is appended to every partition
  of the transaction, and an aborted transaction's range is remembered, so fetches
  list it in ``aborted_transactions`` and clients drop its records;
* offsets sent with TxnOffsetCommit are committed to storage only on commit.

A gateway restart forgets open transactions and aborted ranges (see docs/kafka.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polymq.storage.model import QueueRef

__all__ = ["AbortedRange", "PendingOffset", "Transaction", "TransactionState"]


@dataclass(frozen=True, slots=True)
class AbortedRange:
    producer_id: int
    first_offset: int
    last_offset: int  # the abort marker's offset


@dataclass(frozen=True, slots=True)
class PendingOffset:
    group: str
    queue: QueueRef
    offset: int
    metadata: str


@dataclass(slots=True)
class Transaction:
    transactional_id: str
    producer_id: int
    epoch: int
    partitions: set[QueueRef] = field(default_factory=set)
    offsets: list[PendingOffset] = field(default_factory=list)


class TransactionState:
    def __init__(self) -> None:
        self._transactions: dict[tuple[str, str], Transaction] = {}
        self._open: dict[QueueRef, dict[int, int]] = {}  # queue -> producer id -> first
        self._aborted: dict[QueueRef, list[AbortedRange]] = {}

    def begin(self, namespace: str, transactional_id: str, producer_id: int, epoch: int) -> None:
        """Record the producer of ``transactional_id`` (after InitProducerId)."""
        self._transactions[(namespace, transactional_id)] = Transaction(
            transactional_id, producer_id, epoch
        )

    def get(self, namespace: str, transactional_id: str) -> Transaction | None:
        return self._transactions.get((namespace, transactional_id))

    def produced(self, queue: QueueRef, producer_id: int, base_offset: int) -> None:
        """A transactional batch landed at ``base_offset``: the transaction is open
        there from its first batch on."""
        self._open.setdefault(queue, {}).setdefault(producer_id, base_offset)

    def close(self, queue: QueueRef, producer_id: int, marker_offset: int, *, commit: bool) -> None:
        first = self._open.get(queue, {}).pop(producer_id, None)
        if first is not None and not commit:
            ranges = self._aborted.setdefault(queue, [])
            ranges.append(AbortedRange(producer_id, first, marker_offset))

    def last_stable(self, queue: QueueRef, high_watermark: int) -> int:
        return min(self._open.get(queue, {}).values(), default=high_watermark)

    def aborted(self, queue: QueueRef, start: int, end: int) -> list[AbortedRange]:
        """Aborted ranges overlapping offsets [start, end)."""
        return [
            r
            for r in self._aborted.get(queue, ())
            if r.last_offset >= start and r.first_offset < end
        ]
