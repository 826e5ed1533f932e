"""The chaos bench's verdict: a protocol's history (what producers were promised, what
consumers got) against the kills, as figures.

* **lost**: acknowledged, never delivered, and (where a final re-read of everything
  stored exists: Kafka) not stored either. The one figure that must be 0.
* **undelivered**: acknowledged and stored (the re-read found it) but never delivered
  to the consumer: a consumer that stalled, not data that is gone.
* **stored duplicates**: one id at two storage positions (where the protocol shows
  them: Kafka offsets, from deliveries and the re-read; MNS message ids), i.e. the
  server kept two copies of one acknowledged send, which an idempotent Kafka
  producer must never cause.
* **redeliveries**: deliveries beyond one per stored copy (allowed by every protocol
  here after a failure: at-least-once).
* **reordered**: first deliveries of a producer's messages in one ordered place (a
  partition, a queue, a topic) whose sequence is below one already delivered there.
* **longest outage**: the longest time a protocol's producers went without one
  acknowledgement, and the kill that came last before it ended.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from bench.chaos_history import Delivery, History
from bench.chaos_killer import Kill

__all__ = ["Figures", "check"]

Id = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Figures:
    protocol: str
    sent: int
    acknowledged: int
    delivered: int  # distinct ids
    deliveries: int
    lost: int
    lost_sample: tuple[str, ...]
    undelivered: int  # acknowledged, stored, never delivered (only with a re-read)
    audited: int | None  # messages the final re-read found stored, if there was one
    unconfirmed_delivered: int  # delivered but never acknowledged: allowed
    redeliveries: int
    stored_duplicates: int | None  # None: the protocol does not show storage positions
    reordered: int | None  # None: the client does not say where order holds
    longest_outage_s: float
    outage_from_s: float  # seconds since the run began
    outage_after_kill: str  # "#12 storage-2", or "" if no kill came before it
    errors: int
    top_errors: tuple[tuple[str, int], ...]
    reconnects: int
    stuck: tuple[str, ...]
    foreign: int


def _stored_copies(deliveries: Sequence[Delivery]) -> dict[Id, set[str]]:
    copies: dict[Id, set[str]] = defaultdict(set)
    for d in deliveries:
        if d.stored_at is not None:
            copies[(d.producer, d.seq)].add(d.stored_at)
    return copies


def _reordered(deliveries: Sequence[Delivery]) -> int | None:
    if any(d.queue is None for d in deliveries):
        return None
    highest: dict[tuple[str, str | None], int] = {}
    seen: set[Id] = set()
    count = 0
    for d in sorted(deliveries, key=lambda d: d.at):
        if (d.producer, d.seq) in seen:
            continue
        seen.add((d.producer, d.seq))
        place = (d.producer, d.queue)
        if d.seq < highest.get(place, -1):
            count += 1
        highest[place] = max(highest.get(place, -1), d.seq)
    return count


def _outage(
    ack_times: Sequence[float], begin: float, end: float, kills: Sequence[Kill]
) -> tuple[float, float, str]:
    """The longest gap between acknowledgements from ``begin`` (the first kill) to
    ``end`` (producers told to stop), counting the stretch to ``end`` after the last."""
    times = sorted(t for t in ack_times if begin <= t <= end)
    marks = [begin, *times, end]
    gap, start, stop = 0.0, begin, begin
    for a, b in itertools.pairwise(marks):
        if b - a > gap:
            gap, start, stop = b - a, a, b
    before = [k for k in kills if k.killed_at <= stop]
    label = f"#{before[-1].number} {before[-1].name}" if before else ""
    return gap, start, label


def check(
    history: History, kills: Sequence[Kill], *, begin: float, end: float, origin: float
) -> Figures:
    """``begin``/``end``: the window the outage is measured in; ``origin``: the time
    the run began (the table's times are counted from it)."""
    acked, deliveries = history.snapshot()
    audit = history.audit
    delivered = {(d.producer, d.seq) for d in deliveries}
    stored = {(d.producer, d.seq) for d in audit or ()}
    never_delivered = set(acked) - delivered
    lost = sorted(never_delivered - stored)
    copies = _stored_copies([*deliveries, *(audit or ())])
    exposed = any(d.stored_at is not None for d in [*deliveries, *(audit or ())])
    stored_duplicates = sum(len(c) - 1 for c in copies.values()) if exposed else None
    # One delivery per stored copy is expected; where positions are not shown, one per id.
    delivered_copies = _stored_copies(deliveries)
    expected = sum(max(len(delivered_copies.get(i, ())), 1) for i in delivered)
    gap, gap_from, after = _outage(list(acked.values()), begin, end, kills)
    return Figures(
        protocol=history.protocol,
        sent=history.sent,
        acknowledged=len(acked),
        delivered=len(delivered),
        deliveries=len(deliveries),
        lost=len(lost),
        lost_sample=tuple(f"{p}/{s}" for p, s in lost[:10]),
        undelivered=len(never_delivered) - len(lost),
        audited=None if audit is None else len(audit),
        unconfirmed_delivered=len(delivered - set(acked)),
        redeliveries=len(deliveries) - expected,
        stored_duplicates=stored_duplicates,
        reordered=_reordered(deliveries),
        longest_outage_s=gap,
        outage_from_s=gap_from - origin,
        outage_after_kill=after,
        errors=sum(history.errors.values()),
        top_errors=tuple(history.errors.most_common(5)),
        reconnects=sum(history.reconnects.values()),
        stuck=tuple(history.stuck),
        foreign=history.foreign,
    )
