"""Per-queue index: one fixed-size entry per offset, pointing into the commit log.

An entry of size 0 is a gap: an offset compaction removed (readers skip it, as Kafka
consumers skip the offsets its cleaner removed). Positions never decrease along a
queue, gaps included (a gap takes its successor's position), so binary searches by
position stay valid after a compaction.

An entry is ``position u64 | size u32 | batch_index u16 | batch_count u16 |
store_ms i64 | group_hash u32 | tag_hash u32`` (32 bytes), as RocketMQ's consume
queue keeps the tag hash beside the position so filters and FIFO groups need no read
of the message. Entries live in memory (a ``bytearray`` from ``base`` on) and are
persisted to ``<topic_id>-<queue_id>.idx`` at checkpoints; the commit log is the
write-ahead log that rebuilds anything newer.
"""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import NamedTuple

__all__ = ["ENTRY_SIZE", "IndexEntry", "QueueIndex", "load_index_file", "write_index_file"]

_ENTRY = struct.Struct("<QIHHqII")
ENTRY_SIZE = _ENTRY.size
_FILE_HEADER = struct.Struct("<4sIQ")
_MAGIC = b"PMQI"
_VERSION = 1


class IndexEntry(NamedTuple):
    position: int
    size: int
    batch_index: int
    batch_count: int
    store_ms: int
    group_hash: int
    tag_hash: int


class QueueIndex:
    """Offsets ``[base, end)`` of one queue. ``next_offset`` runs ahead of ``end`` by
    the appends reserved but not yet durable (readers see only ``end``)."""

    __slots__ = (
        "base",
        "earliest",
        "entries",
        "file_base",
        "next_offset",
        "persisted_end",
        "waiters",
    )

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.earliest = base  # first offset readers may see (retention moves it)
        self.entries = bytearray()
        self.next_offset = base
        self.persisted_end = base  # entries below this are in the index file
        self.file_base: int | None = None  # first offset in the index file, if any
        self.waiters: list[asyncio.Future[None]] | None = None

    @property
    def end(self) -> int:
        return self.base + len(self.entries) // ENTRY_SIZE

    def append_record(
        self, position: int, size: int, count: int, store_ms: int, group_hash: int, tag_hash: int
    ) -> None:
        """Index one stored record spanning ``count`` offsets (a batch: one entry each)."""
        pack = _ENTRY.pack
        if count == 1:
            self.entries += pack(position, size, 0, 1, store_ms, group_hash, tag_hash)
            return
        self.entries += b"".join(
            pack(position, size, index, count, store_ms, group_hash, tag_hash)
            for index in range(count)
        )

    def put(self, offset: int, entry: IndexEntry) -> None:
        """Overwrite one entry (compaction re-points kept offsets and empties others)."""
        _ENTRY.pack_into(self.entries, (offset - self.base) * ENTRY_SIZE, *entry)

    def get(self, offset: int) -> IndexEntry:
        return IndexEntry._make(_ENTRY.unpack_from(self.entries, (offset - self.base) * ENTRY_SIZE))

    def position(self, offset: int) -> int:
        (position,) = struct.unpack_from("<Q", self.entries, (offset - self.base) * ENTRY_SIZE)
        return int(position)

    def store_ms(self, offset: int) -> int:
        (value,) = struct.unpack_from("<q", self.entries, (offset - self.base) * ENTRY_SIZE + 16)
        return int(value)

    def first_offset_where(self, field: str, at_least: int) -> int:
        """Binary search for the first offset whose ``position`` or ``store_ms`` is at
        least ``at_least`` (both grow along a queue); ``end`` if none."""
        getter = self.position if field == "position" else self.store_ms
        low, high = self.base, self.end
        while low < high:
            middle = (low + high) // 2
            if getter(middle) < at_least:
                low = middle + 1
            else:
                high = middle
        return low

    def trim_to(self, offset: int) -> None:
        """Forget entries below ``offset`` (their log segments are gone)."""
        offset = min(offset, self.end)
        if offset > self.base:
            del self.entries[: (offset - self.base) * ENTRY_SIZE]
            self.base = offset
            self.earliest = max(self.earliest, offset)

    def truncate(self, end: int) -> None:
        """Drop entries at or above ``end`` (they point past a cut log tail)."""
        if end < self.end:
            del self.entries[(max(end, self.base) - self.base) * ENTRY_SIZE :]
        self.next_offset = self.end
        self.persisted_end = min(self.persisted_end, self.end)

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, None
        for future in waiters or ():
            if not future.done():
                future.set_result(None)


def write_index_file(path: Path, base: int, data: bytes, *, append: bool) -> None:
    """Persist entries. ``append`` adds ``data`` at the end of an existing file with the
    same base; otherwise the file is replaced atomically. Runs in a worker thread."""
    if append and path.exists():
        with open(path, "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        handle.write(_FILE_HEADER.pack(_MAGIC, _VERSION, base))
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_index_file(path: Path) -> tuple[int, bytearray, bool] | None:
    """``(base, entries, intact)`` from a file, whole entries only; ``None`` if
    unreadable. ``intact`` is false when a torn append left part of an entry at the
    end: the file must then be rewritten, never appended to."""
    data = path.read_bytes()
    if len(data) < _FILE_HEADER.size:
        return None
    magic, version, base = _FILE_HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        return None
    body = data[_FILE_HEADER.size :]
    torn = len(body) % ENTRY_SIZE
    return int(base), bytearray(body[: len(body) - torn]), torn == 0
