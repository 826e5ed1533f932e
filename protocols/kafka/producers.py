"""Idempotent producers: ids, epochs and per-partition sequence numbers (KIP-98).

Kept in this gateway's memory: a batch from a producer (or a partition) this gateway
has no state for (another gateway had it, or this one restarted) is accepted whatever
its sequence, as Kafka accepts one after the producer's state expired, and starts the
sequence afresh; retries that cross gateways or a restart are still caught by the
append's dedup key. Kafka remembers the last five batches per
partition, so a retry of any of them gets its first answer again.

A batch whose append failed with storage out of reach is *unsettled*: the storage
node may have stored it before the connection dropped (killed after its write, before
its answer). Until a retry of that batch settles it (the append's dedup key returns
the first copy if there is one), later batches of the producer are refused with a
retryable error, never OUT_OF_ORDER_SEQUENCE_NUMBER: a client takes that as proof the
batch before was not stored, bumps its epoch and sends those records again under new
sequence numbers, which no dedup key recognises (librdkafka does, issue 22).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from polymq.storage.model import QueueRef

__all__ = ["ProducerRegistry", "SequenceCheck", "Verdict"]

_REMEMBERED_BATCHES = 5
_SEQUENCE_WRAP = 1 << 31


class Verdict(Enum):
    ACCEPT = "accept"
    DUPLICATE = "duplicate"
    OUT_OF_ORDER = "out_of_order"
    FENCED = "fenced"
    UNSETTLED = "unsettled"  # an earlier batch's fate is unknown: retry later


@dataclass(frozen=True, slots=True)
class SequenceCheck:
    verdict: Verdict
    offset: int = -1  # the first answer's base offset, for a duplicate


@dataclass(slots=True)
class _Partition:
    epoch: int
    next_sequence: int | None = None  # None: nothing seen yet from this producer
    recent: deque[tuple[int, int, int]] = field(
        default_factory=lambda: deque(maxlen=_REMEMBERED_BATCHES)
    )  # (first sequence, last sequence, base offset)
    unsettled: tuple[int, int] | None = None  # (first, last) of a batch of unknown fate


class ProducerRegistry:
    def __init__(self, node: int = 0) -> None:
        # Ids seeded from the clock so a restarted gateway does not reuse live ids, and
        # from the gateway's node id so two gateways never hand out the same one (the
        # append dedup keys name producer ids).
        start = (node & 0x7FFF) << 48 | (int(time.time() * 1000) % (1 << 40)) << 8
        self._ids = itertools.count(start)
        self._epochs: dict[int, int] = {}
        self._transactional: dict[str, int] = {}
        self._partitions: dict[tuple[int, QueueRef], _Partition] = {}

    def init_producer(self, transactional_id: str | None) -> tuple[int, int]:
        """A producer id and epoch; a transactional id keeps its id and bumps the
        epoch, fencing the previous instance."""
        if transactional_id:
            producer_id = self._transactional.get(transactional_id)
            if producer_id is not None:
                epoch = self._epochs[producer_id] + 1
                self._epochs[producer_id] = epoch
                return producer_id, epoch
        producer_id = next(self._ids)
        self._epochs[producer_id] = 0
        if transactional_id:
            self._transactional[transactional_id] = producer_id
        return producer_id, 0

    def check(
        self, producer_id: int, epoch: int, queue: QueueRef, first: int, count: int
    ) -> SequenceCheck:
        known_epoch = self._epochs.get(producer_id)
        if known_epoch is not None and epoch < known_epoch:
            return SequenceCheck(Verdict.FENCED)
        state = self._partitions.get((producer_id, queue))
        if state is None or epoch > state.epoch:
            return SequenceCheck(Verdict.ACCEPT)
        last = (first + count - 1) % _SEQUENCE_WRAP
        if state.unsettled is not None:
            # Its retry goes through (its dedup key settles it); nothing else may.
            verdict = Verdict.ACCEPT if state.unsettled[0] == first else Verdict.UNSETTLED
            return SequenceCheck(verdict)
        if state.next_sequence is None:
            return SequenceCheck(Verdict.ACCEPT)
        for seen_first, seen_last, offset in state.recent:
            if seen_first == first and seen_last == last:
                return SequenceCheck(Verdict.DUPLICATE, offset)
        if first != state.next_sequence:
            return SequenceCheck(Verdict.OUT_OF_ORDER)
        return SequenceCheck(Verdict.ACCEPT)

    def record(
        self, producer_id: int, epoch: int, queue: QueueRef, first: int, count: int, offset: int
    ) -> None:
        state = self._state(producer_id, epoch, queue)
        last = (first + count - 1) % _SEQUENCE_WRAP
        state.recent.append((first, last, offset))
        state.next_sequence = (last + 1) % _SEQUENCE_WRAP
        state.unsettled = None

    def unsettle(
        self, producer_id: int, epoch: int, queue: QueueRef, first: int, count: int
    ) -> None:
        """The append of this batch may or may not have been stored (see the module
        docstring): hold the producer's later batches back until it is retried."""
        state = self._state(producer_id, epoch, queue)
        state.unsettled = (first, (first + count - 1) % _SEQUENCE_WRAP)

    def _state(self, producer_id: int, epoch: int, queue: QueueRef) -> _Partition:
        key = (producer_id, queue)
        state = self._partitions.get(key)
        if state is None or epoch > state.epoch:
            state = self._partitions[key] = _Partition(epoch=epoch)
        if self._epochs.get(producer_id, -1) < epoch:
            self._epochs[producer_id] = epoch
        return state
