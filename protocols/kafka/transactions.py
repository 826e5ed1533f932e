"""Kafka transactions (KIP-98): the coordinator's view, kept in its gateway's memory.

Transactional records are stored at once, as Kafka stores them; what makes them
transactional is bookkeeping around them. The coordinator keeps here, per
transactional id, its producer and the partitions and offsets of the transaction
under way; offsets sent with TxnOffsetCommit are committed to storage only on commit.
What every partition's leader must know (which transactions are open there, from which
offset, and which were aborted) is kept in storage instead, since the leader is often
another gateway (protocols/kafka/txn_log.py).
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
    # Per partition joined: its end offset when it joined (no record of the
    # transaction is below), as written to storage.
    first_offsets: dict[QueueRef, int] = field(default_factory=dict)


class TransactionState:
    def __init__(self) -> None:
        self._transactions: dict[tuple[str, str], Transaction] = {}

    def begin(self, namespace: str, transactional_id: str, producer_id: int, epoch: int) -> None:
        """Record the producer of ``transactional_id`` (after InitProducerId)."""
        self._transactions[(namespace, transactional_id)] = Transaction(
            transactional_id, producer_id, epoch
        )

    def get(self, namespace: str, transactional_id: str) -> Transaction | None:
        return self._transactions.get((namespace, transactional_id))

    def adopt(self, namespace: str, txn: Transaction) -> None:
        """Take over a transaction another coordinator began (read from storage)."""
        self._transactions[(namespace, txn.transactional_id)] = txn
