"""Space reclaim for MNS queues: a deleted (acked) message is gone for MNS, so the
queue's records below its group's acked prefix may go too.

An MNS queue has unlimited retention (messages stay until deleted), so without this its
log segments would be kept forever. Trimming per delete would cost a durable write per
message; instead each queue counts its deletes and, every ``every`` of them, moves the
queue's start up to the group's ``consumed_below`` with one ``delete_records``.
Readers of the same topic over other protocols see the start move, as with retention.
"""

from __future__ import annotations

import logging

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.mns.priority import levels_of, refs_in_pop_order
from polymq.storage.errors import StorageError
from polymq.storage.model import QueueRef

__all__ = ["RECLAIM_EVERY", "Reclaimer"]

log = logging.getLogger(__name__)

RECLAIM_EVERY = 256


class Reclaimer:
    def __init__(self, processor: Processor, *, every: int = RECLAIM_EVERY) -> None:
        self._processor = processor
        self._every = max(1, every)
        self._deletes: dict[tuple[str, str], int] = {}  # (namespace, queue): since last trim

    async def deleted(self, caller: Caller, queue: str, group: str, count: int) -> None:
        """``count`` messages of ``queue`` were just deleted (acked) by ``group``: every
        priority level is trimmed."""
        if count <= 0:
            return
        key = (caller.namespace, queue)
        total = self._deletes.get(key, 0) + count
        if total < self._every:
            self._deletes[key] = total
            return
        self._deletes[key] = 0
        try:
            info = await self._processor.describe_topic(caller, queue)
            for ref in refs_in_pop_order(caller.namespace, queue, levels_of(info)):
                await self.reclaim(caller, ref, group)
        except StorageError as e:  # the deletes stand; the next trim catches up
            log.warning("mns: could not reclaim queue %s/%s: %s", caller.namespace, queue, e)

    async def reclaim(self, caller: Caller, ref: QueueRef, group: str) -> int:
        """Trim one storage queue to the group's acked prefix now; returns the new
        start."""
        below = await self._processor.consumed_below(caller, group, ref)
        offsets = await self._processor.queue_offsets(caller, ref)
        if below <= offsets.earliest:
            return offsets.earliest
        return (await self._processor.delete_records(caller, ref, below)).earliest

    def forget(self, caller: Caller, queue: str) -> None:
        self._deletes.pop((caller.namespace, queue), None)
