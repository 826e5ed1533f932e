"""Messages this gateway requeued: ready again, but still in flight to storage.

A requeue (basic.reject or basic.nack with requeue, basic.recover, a channel or
connection closed with unacked deliveries) gives the message back to storage with
``nack``: visible at once, at its offset (pops hand out redeliveries first, lowest
offset first, so it keeps its place, as in RabbitMQ), and redelivered. Storage keeps
counting it as handed out until it is handed out again, though
(``inflight_count``: handed out and not acked), so a queue's ready count,
``pending - inflight``, would miss it. This gateway remembers what it gave back
and adds it to the count until one of its own pops takes it again.

Known gap: a message requeued here and taken by another gateway's pop stays counted
here until it is acked below the queue's consumed prefix, and one whose lease ran out
(its gateway died) is not counted until it is taken again; a storage count of the
handed-out messages visible now would close both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from polymq.storage.model import QueueRef, StoredMessage

__all__ = ["Requeued"]


class Requeued:
    """Per storage queue, the offsets this gateway gave back and has not popped since."""

    def __init__(self) -> None:
        self._offsets: dict[QueueRef, set[int]] = {}

    def given_back(self, message: StoredMessage) -> None:
        self._offsets.setdefault(message.queue, set()).add(message.offset)

    def taken(self, messages: Iterable[StoredMessage]) -> None:
        """Messages a pop of this gateway handed out: in flight again."""
        if not self._offsets:
            return
        for message in messages:
            offsets = self._offsets.get(message.queue)
            if offsets is not None:
                offsets.discard(message.offset)
                if not offsets:
                    del self._offsets[message.queue]

    def waiting(self, queue: QueueRef) -> bool:
        return queue in self._offsets

    def ready(self, queue: QueueRef, consumed_below: int, inflight: int) -> int:
        """How many of the queue's in-flight messages are ready again: those given
        back, less what was consumed since (below the group's consumed prefix), never
        more than storage has in flight."""
        offsets = self._offsets.get(queue)
        if not offsets:
            return 0
        stale = [o for o in offsets if o < consumed_below]
        offsets.difference_update(stale)
        if not offsets:
            del self._offsets[queue]
            return 0
        return min(len(offsets), inflight)

    def forget(self, queues: Sequence[QueueRef]) -> None:
        """The queues were deleted (a queue declared again under the name starts anew)."""
        for queue in queues:
            self._offsets.pop(queue, None)
