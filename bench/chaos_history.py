"""What the chaos bench's clients saw, recorded as it happens, for the checker.

Each protocol has one :class:`History`, written by its producer and consumer threads.
A producer records a message as acknowledged only once its client library reported
success (a delivery report, a publisher confirm, a PUBACK, a send receipt, a 201), so
the checker's "lost" means exactly what a client was promised and did not get.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Delivery", "History", "body", "delivery", "parse_body"]

_MAGIC = "chaos"


def body(producer: str, seq: int) -> bytes:
    """The message: its unique id (producer, sequence) in plain text, so every
    protocol carries it unchanged and a person reading a queue can tell whose it is."""
    return f"{_MAGIC} {producer} {seq:09d}".encode()


def parse_body(raw: bytes | str | None) -> tuple[str, int] | None:
    """(producer, sequence), or ``None`` for a message the bench did not send."""
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    parts = text.split(" ")
    if len(parts) != 3 or parts[0] != _MAGIC or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery to a consumer. ``queue`` is where the protocol promises order (a
    partition, a queue, a topic), ``None`` where the client does not say. ``stored_at``
    is the storage position where the protocol exposes one (a Kafka offset, an MNS
    message id assigned by the server): two different positions for one id are two
    stored copies, not a redelivery."""

    producer: str
    seq: int
    queue: str | None
    stored_at: str | None
    at: float
    redelivered: bool = False


def delivery(
    raw: bytes | str | None,
    *,
    queue: str | None,
    stored_at: str | None = None,
    redelivered: bool = False,
) -> Delivery | None:
    """A message read now, or ``None`` if the bench did not send it."""
    parsed = parse_body(raw)
    if parsed is None:
        return None
    return Delivery(parsed[0], parsed[1], queue, stored_at, time.monotonic(), redelivered)


@dataclass(slots=True)
class History:
    """One protocol's record. Every method takes the lock: several client threads
    write, and the checker reads once they stopped (or gave up on them)."""

    protocol: str
    sent: int = 0
    acked: dict[tuple[str, int], float] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    foreign: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    reconnects: Counter[str] = field(default_factory=Counter)  # by "producer"/"consumer"
    stuck: list[str] = field(default_factory=list)
    # What a reader that starts over found stored at the end (Kafka: every partition
    # from offset 0), where the protocol allows one; ``None`` where it does not.
    audit: list[Delivery] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_sent(self) -> None:
        with self._lock:
            self.sent += 1

    def on_acked(self, producer: str, seq: int) -> None:
        with self._lock:
            self.acked.setdefault((producer, seq), time.monotonic())

    def on_delivered(
        self,
        raw: bytes | str | None,
        *,
        queue: str | None,
        stored_at: str | None = None,
        redelivered: bool = False,
    ) -> None:
        found = delivery(raw, queue=queue, stored_at=stored_at, redelivered=redelivered)
        with self._lock:
            if found is None:
                self.foreign += 1
            else:
                self.deliveries.append(found)

    def record_audit(self, found: list[Delivery]) -> None:
        with self._lock:
            self.audit = found

    def on_error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def on_reconnect(self, side: str) -> None:
        with self._lock:
            self.reconnects[side] += 1

    def on_stuck(self, worker: str) -> None:
        with self._lock:
            self.stuck.append(worker)

    def snapshot(self) -> tuple[dict[tuple[str, int], float], list[Delivery]]:
        with self._lock:
            return dict(self.acked), list(self.deliveries)

    def acked_ids(self) -> set[tuple[str, int]]:
        with self._lock:
            return set(self.acked)

    def missing(self) -> set[tuple[str, int]]:
        """Acknowledged, not (yet) delivered."""
        return self.acked_ids() - self.delivered_ids()

    def delivered_ids(self) -> set[tuple[str, int]]:
        with self._lock:
            return {(d.producer, d.seq) for d in self.deliveries}
