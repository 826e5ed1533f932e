"""Reading stored messages: by offset (stream mode), as whole batches, and the message
lookups that pops and acks share.

Decoded batches are cached (``EngineCore.decoded``) because their messages are usually
read one offset after another; appends put a just-appended message there too, since
a consumer usually pops it soon after. Reads wait for data (long polls) on the
queues' own waiters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from polymq.storage import batch_formats
from polymq.storage.engine import records as rec
from polymq.storage.engine.core import EngineCore, EnginePart
from polymq.storage.engine.queue_index import IndexEntry, QueueIndex
from polymq.storage.errors import OffsetOutOfRange, StorageError
from polymq.storage.model import (
    BatchEntry,
    Message,
    QueueOffsets,
    QueueRef,
    ReadResult,
    StoredBatch,
    StoredMessage,
)

__all__ = ["DECODED_CACHE", "Reads", "stored_message"]

_YIELD_EVERY = 256  # read_batches entries decoded between two yields to the event loop
_GAP_SCAN = 65_536  # offsets a read looks past compaction's gaps for messages
DECODED_CACHE = 64  # decoded entries kept (EngineCore.decoded)


class Reads(EnginePart):
    """The read side of one engine."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self._decoded = core.decoded

    def forget_decoded(self) -> None:
        """Drop the cache: the positions it names may be gone with their segments."""
        self._decoded.clear()

    def _decode_at(
        self, position: int, payload: bytes | memoryview, *, messages: bool = True
    ) -> tuple[str, Message | BatchEntry]:
        """Message id and entry of the message record at ``position``. Decoded batches
        are cached, since their messages are usually read one offset after another;
        ``messages=False`` leaves a batch's messages undecoded (raw is enough)."""
        message_id, encoded = rec.read_message_entry(payload)
        entry = rec.decode_entry(encoded, messages=messages)
        if isinstance(entry, BatchEntry) and messages:
            if not entry.messages:
                entry = replace(entry, messages=batch_formats.expand(entry.format, entry.raw))
            self._decoded[position] = (message_id, entry)
            if len(self._decoded) > DECODED_CACHE:
                self._decoded.popitem(last=False)
        return message_id, entry

    def _load(
        self, position: int, size: int, *, messages: bool = True
    ) -> tuple[str, Message | BatchEntry]:
        cached = self._decoded.get(position)
        if cached is not None:
            self._decoded.move_to_end(position)
            return cached
        return self._decode_at(position, self._log.read(position, size), messages=messages)

    def messages_at(self, entries: Sequence[IndexEntry]) -> list[tuple[Message, str]]:
        """The messages of several index entries, neighbours read with one call."""
        if len(entries) == 1:
            entry = entries[0]
            return [_member(entry, *self._load(entry.position, entry.size))]
        wanted: dict[int, int] = {}
        for entry in entries:
            if entry.position not in self._decoded:
                wanted.setdefault(entry.position, entry.size)
        spans = list(wanted.items())
        payloads = dict(zip(wanted, self._log.read_many(spans), strict=True))
        decoded: dict[int, tuple[str, Message | BatchEntry]] = {}
        result = []
        for entry in entries:
            found = decoded.get(entry.position)
            if found is None:
                payload = payloads.get(entry.position)
                found = decoded[entry.position] = (
                    self._load(entry.position, entry.size)
                    if payload is None
                    else self._decode_at(entry.position, payload)
                )
            result.append(_member(entry, *found))
        return result

    def stored(self, ref: QueueRef, queue: QueueIndex, offset: int, **extra: Any) -> StoredMessage:
        entry = queue.get(offset)
        [(message, message_id)] = self.messages_at([entry])
        return stored_message(message, message_id, ref, offset, entry, **extra)

    async def wait_for_data(
        self, queues: Iterable[QueueIndex], deadline_ms: int, wake_at_ms: int | None = None
    ) -> None:
        """Sleep until a queue gets data, ``wake_at_ms`` or ``deadline_ms``."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watched = list(queues)
        for queue in watched:
            if queue.waiters is None:
                queue.waiters = []
            queue.waiters.append(future)
        until = deadline_ms if wake_at_ms is None else min(deadline_ms, wake_at_ms)
        stop_alarm = self._core.clock.wake_at(until, future)
        try:
            await future
        finally:
            stop_alarm()
            future.cancel()
            for queue in watched:
                if queue.waiters and future in queue.waiters:
                    queue.waiters.remove(future)

    async def _readable(self, ref: QueueRef, offset: int, wait_ms: int) -> QueueIndex:
        """The queue's index once ``offset`` is valid, after a long poll if it is the end
        (or only compaction's gaps lie between it and the end)."""
        self._core.check_open()
        _, index = self._state.queue(ref)
        _check_offset(ref, index, offset)
        if wait_ms > 0 and _nothing_from(index, offset):
            await self.wait_for_data([index], self._core.now() + wait_ms)
            self._core.check_open()
            _, index = self._state.queue(ref)  # the topic may be gone by now
            _check_offset(ref, index, offset)
        return index

    async def read(
        self, queue: QueueRef, offset: int, max_messages: int, max_bytes: int, wait_ms: int
    ) -> ReadResult:
        index = await self._readable(queue, offset, wait_ms)
        messages: list[StoredMessage] = []
        total = 0
        wanted = max(1, max_messages)
        stop = min(index.end, offset + wanted)
        entries = [(c, e) for c in range(offset, stop) if (e := index.get(c)).size]
        scanned = stop
        while len(entries) < wanted and scanned < index.end and scanned - offset < _GAP_SCAN:
            # Compaction's gaps (size 0) hold no message: look further, within a bound.
            entry = index.get(scanned)
            if entry.size:
                entries.append((scanned, entry))
            scanned += 1
        next_offset = scanned
        loaded = self.messages_at([e for _, e in entries])
        for (current, entry), (message, message_id) in zip(entries, loaded, strict=True):
            total += len(message.body)
            if messages and total > max_bytes:
                next_offset = current
                break
            messages.append(stored_message(message, message_id, queue, current, entry))
        return ReadResult(
            messages=tuple(messages),
            next_offset=next_offset,
            offsets=QueueOffsets(index.earliest, index.end),
        )

    async def read_batches(
        self, queue: QueueRef, offset: int, max_bytes: int, wait_ms: int
    ) -> list[StoredBatch]:
        index = await self._readable(queue, offset, wait_ms)
        batches: list[StoredBatch] = []
        total = 0
        current = offset
        while current < index.end:
            if batches and len(batches) % _YIELD_EVERY == 0:
                # Thousands of small messages fit in max_bytes: let other tasks run.
                await asyncio.sleep(0)
                self._core.check_open()
                _, now_index = self._state.queue(queue)  # raises if the topic is gone
                if now_index is not index or current < index.earliest:
                    break  # recreated, or retention moved the start meanwhile
            entry = index.get(current)
            if not entry.size:  # a gap left by compaction
                current += 1
                continue
            base = max(current - entry.batch_index, index.base)
            message_id, decoded = self._load(entry.position, entry.size, messages=False)
            if isinstance(decoded, BatchEntry):
                size = len(decoded.raw)
                batch = StoredBatch(
                    queue=queue,
                    base_offset=base,
                    count=entry.batch_count,
                    store_timestamp_ms=entry.store_ms,
                    format=decoded.format,
                    raw=decoded.raw,
                )
            else:
                size = len(decoded.body)
                stored = stored_message(decoded, message_id, queue, current, entry)
                batch = StoredBatch(
                    queue=queue,
                    base_offset=current,
                    count=1,
                    store_timestamp_ms=entry.store_ms,
                    format=None,
                    raw=None,
                    messages=(stored,),
                )
            total += size
            if batches and total > max_bytes:
                break
            batches.append(batch)
            current = base + entry.batch_count
        return batches


def stored_message(
    message: Message, message_id: str, ref: QueueRef, offset: int, entry: IndexEntry, **extra: Any
) -> StoredMessage:
    """The message at ``offset`` of queue ``ref`` (``entry``: its index entry), as the
    storage API hands it out; ``extra``: a pop's delivery fields."""
    return StoredMessage(
        message=message,
        queue=ref,
        offset=offset,
        message_id=message_id,
        store_timestamp_ms=entry.store_ms,
        **extra,
    )


def _check_offset(ref: QueueRef, queue: QueueIndex, offset: int) -> None:
    if offset < queue.earliest or offset > queue.end:
        raise OffsetOutOfRange(
            f"offset {offset} is outside [{queue.earliest}, {queue.end}] of {ref}",
            earliest=queue.earliest,
            latest=queue.end,
        )


def _member(
    entry: IndexEntry, message_id: str, decoded: Message | BatchEntry
) -> tuple[Message, str]:
    """The message an index entry names: the entry itself, or one member of a batch."""
    if isinstance(decoded, Message):
        return decoded, message_id
    if entry.batch_index >= len(decoded.messages):
        raise StorageError(
            f"batch at position {entry.position} expanded to {len(decoded.messages)} "
            f"messages, fewer than its {entry.batch_count} offsets"
        )
    if entry.batch_count > 1:
        message_id = f"{message_id}-{entry.batch_index}"
    return decoded.messages[entry.batch_index], message_id


def _nothing_from(index: QueueIndex, offset: int) -> bool:
    """Whether no record lies at or after ``offset``: the end, or gaps up to it (looked
    at within a bound: past it, the read itself skips them)."""
    stop = offset + _GAP_SCAN
    if stop < index.end:
        return False
    return not any(index.get(current).size for current in range(offset, index.end))
