"""The engine's in-memory state, and the functions that apply log records to it.

The same ``apply_*`` methods serve a live call and a replay after a crash, so what a
restart rebuilds is by construction what the running engine had. Nothing here does
I/O: :mod:`storage.engine.core` owns the files and the write gate, and
:mod:`storage.engine.engine` the public API.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import heapq
import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import crc32c

from polymq.storage.clock import Clock
from polymq.storage.engine import records as rec
from polymq.storage.engine.pop_state import Inflight, PopCursor
from polymq.storage.engine.queue_index import IndexEntry, QueueIndex
from polymq.storage.errors import NamespaceNotFound, QueueNotFound, TopicNotFound
from polymq.storage.model import (
    UNLIMITED,
    CommittedOffset,
    GroupConfig,
    MessageType,
    QueueOffsets,
    QueueRef,
    TopicConfig,
    TopicInfo,
)

__all__ = [
    "EngineState",
    "GroupKey",
    "Held",
    "QueueKey",
    "Seen",
    "Topic",
    "config_to_json",
    "text_hash",
    "topic_config",
]

log = logging.getLogger(__name__)

QueueKey = tuple[int, int]  # (topic id, queue id)
GroupKey = tuple[str, str]  # (namespace, group)


def text_hash(text: str | None) -> int:
    """Non-zero 32-bit hash of a tag or message group; 0 means none."""
    if text is None:
        return 0
    return crc32c.crc32c(text.encode()) or 1


@dataclass(slots=True)
class Topic:
    id: int
    namespace: str
    name: str
    config: TopicConfig
    created_ms: int
    modified_ms: int
    queues: list[QueueIndex]

    def keeps_everything(self) -> bool:
        return self.config.retention_ms == UNLIMITED or self.config.retention_bytes == UNLIMITED


@dataclass(slots=True)
class Seen:
    """What an append with a dedup key returned, kept for the dedup window."""

    expires_ms: int
    message_id: str
    store_ms: int
    dispatches: tuple[tuple[int, int, int], ...]  # (topic id, queue id, offset)


@dataclass(slots=True)
class Held:
    """A stored message not yet in any queue: delayed, or a transaction half."""

    position: int
    size: int
    namespace: str
    record: rec.MessageRecord

    @property
    def is_half(self) -> bool:
        return bool(self.record.flags & rec.MESSAGE_HALF)


@functools.lru_cache(maxsize=4096)
def config_to_json(config: TopicConfig | GroupConfig) -> dict[str, Any]:
    """Configs are frozen and mostly shared, so each is converted once (``asdict`` is
    slow, and a checkpoint converts every topic's while writers wait). Callers must not
    mutate the result."""
    return asdict(config)


@functools.lru_cache(maxsize=1024)
def _interned_topic_config(items: tuple[tuple[str, Any], ...]) -> TopicConfig:
    data = dict(items)
    return TopicConfig(**{**data, "message_type": MessageType(data["message_type"])})


def topic_config(data: dict[str, Any]) -> TopicConfig:
    """One shared object per distinct config: 100,000 one-queue topics (AMQP queues,
    MQTT sessions) mostly share a handful."""
    return _interned_topic_config(tuple(sorted(data.items())))


class EngineState:
    """Namespaces, topics and their queue indexes, consumer state, held messages,
    dedup keys, keyed latest values and protocol metadata."""

    def __init__(self, *, dedup_window_ms: int, clock: Clock) -> None:
        self.dedup_window_ms = dedup_window_ms
        self.clock = clock
        self.namespaces: dict[str, int] = {}
        self.topics: dict[tuple[str, str], Topic] = {}
        self.topics_by_id: dict[int, Topic] = {}
        self.next_topic_id = 1
        self.dead_topic_ids: set[int] = set()
        self.trims: dict[QueueKey, int] = {}  # delete_records: first offset kept
        self.topics_version = 0  # bumped by every topic change
        self.topics_json: tuple[int, list[Any]] = (-1, [])
        self.topics_file: tuple[int, str] | None = None  # (version on disk, file name)
        self.dirty_queues: set[QueueKey] = set()  # new entries since checkpoint
        self.group_configs: dict[GroupKey, GroupConfig] = {}
        self.offsets: dict[GroupKey, dict[QueueKey, CommittedOffset]] = {}
        self.cursors: dict[GroupKey, dict[QueueKey, PopCursor]] = {}
        # Each cursor's checkpoint line, with the cursor version it shows: with 100,000
        # sessions, re-serializing only the changed ones keeps checkpoints short.
        self.cursor_lines: dict[tuple[GroupKey, QueueKey], tuple[int, str]] = {}
        self.held: dict[int, Held] = {}
        self.held_by_id: dict[tuple[str, str], int] = {}
        self.dedup: OrderedDict[tuple[str, str], Seen] = OrderedDict()
        self.due: list[tuple[int, int]] = []  # (due ms, position) of delayed messages
        # Delayed messages held per queue they will go to: counted where a delayed record
        # is held and dropped, so a replay rebuilds the same counts.
        self.delayed: dict[QueueKey, int] = {}
        self.latest: dict[tuple[str, str], dict[bytes, bytes]] = {}
        self.kv: dict[tuple[str, str], dict[str, Any]] = {}
        self.pop_seq = 0
        self.due_changed = asyncio.Event()
        # Copies written by a compaction, by its id, until its closing record applies
        # them (a compaction without one, cut short by a crash, is never applied).
        self.staged_copies: dict[int, list[tuple[int, int, rec.MessageRecord]]] = {}

    def now(self) -> int:
        return self.clock.now_ms()

    def load_snapshot(
        self, s: dict[str, Any], topics: Iterable[list[Any]], cursors: Iterable[list[Any]]
    ) -> None:
        """Load a checkpoint; ``topics`` and ``cursors`` are the rows of the files it
        names."""
        self.next_topic_id = int(s["next_topic_id"])
        self.pop_seq = int(s["pop_seq"])
        self.namespaces = {ns: int(ms) for ns, ms in s["namespaces"].items()}
        topics_file = s["topics_file"]
        for tid, ns, name, config, created, modified, count in topics:
            topic = Topic(
                int(tid), sys.intern(ns), name, topic_config(config), created, modified, []
            )
            self.add_topic(topic, count)
        self.topics_file = (self.topics_version, topics_file)
        for tid, qid, offset in s["trims"]:
            self.trims[(tid, qid)] = offset
            self.topics_by_id[tid].queues[qid].earliest = offset
        for ns, group, config in s["groups"]:
            self.group_configs[(ns, group)] = GroupConfig(**config)
        for ns, group, tid, qid, offset, metadata, ms in s["offsets"]:
            self.offsets.setdefault((ns, group), {})[(tid, qid)] = CommittedOffset(
                offset=offset, metadata=metadata, commit_ms=ms
            )
        for ns, group, tid, qid, data in cursors:
            self.cursors.setdefault((ns, group), {})[(tid, qid)] = PopCursor.from_json(data)
        for ns, topic, key, message in s["latest"]:
            self.latest.setdefault((ns, topic), {})[base64.b64decode(key)] = base64.b64decode(
                message
            )
        for ns, kind, name, value in s["kv"]:
            self.kv.setdefault((ns, kind), {})[name] = value
        self.dead_topic_ids = set(s.get("dead_topic_ids", []))
        for ns, key, expires, message_id, store_ms, dispatches in s["dedup"]:
            self.dedup[(ns, key)] = Seen(
                expires, message_id, store_ms, tuple(tuple(d) for d in dispatches)
            )

    def snapshot_state(self, position: int) -> dict[str, Any]:
        b64 = base64.b64encode
        return {
            "version": 1,
            "position": position,
            "next_topic_id": self.next_topic_id,
            "pop_seq": self.pop_seq,
            "namespaces": self.namespaces,
            "topics_file": self.topics_file_name(position),
            "trims": [[tid, qid, offset] for (tid, qid), offset in self.trims.items()],
            "groups": [[ns, g, config_to_json(c)] for (ns, g), c in self.group_configs.items()],
            "offsets": [
                [ns, g, tid, qid, c.offset, c.metadata, c.commit_ms]
                for (ns, g), per_queue in self.offsets.items()
                for (tid, qid), c in per_queue.items()
            ],
            "cursors_file": f"cursors-{position:020d}.jsonl",
            "held": [[h.position, h.size] for h in self.held.values()],
            "latest": [
                [ns, topic, b64(key).decode(), b64(value).decode()]
                for (ns, topic), values in self.latest.items()
                for key, value in values.items()
            ],
            "kv": [
                [ns, kind, name, value]
                for (ns, kind), values in self.kv.items()
                for name, value in values.items()
            ],
            "dead_topic_ids": sorted(self.dead_topic_ids),
            "dedup": [
                [ns, key, s.expires_ms, s.message_id, s.store_ms, s.dispatches]
                for (ns, key), s in self.dedup.items()
            ],
        }

    def cursor_snapshot_lines(self) -> list[str]:
        """The cursors file's lines (one JSON row per cursor), reusing the line of every
        cursor unchanged since it was last serialized."""
        cache = self.cursor_lines
        lines = []
        for group_key, per_queue in self.cursors.items():
            for queue_key, cursor in per_queue.items():
                key = (group_key, queue_key)
                cached = cache.get(key)
                if cached is None or cached[0] != cursor.version:
                    row = [*group_key, *queue_key, cursor.to_json()]
                    cached = cache[key] = (cursor.version, json.dumps(row, separators=(",", ":")))
                lines.append(cached[1])
        if len(cache) > 2 * len(lines) + 1024:  # forget the lines of deleted cursors
            live = {(g, q) for g, per_queue in self.cursors.items() for q in per_queue}
            self.cursor_lines = {k: v for k, v in cache.items() if k in live}
        return lines

    def topics_file_name(self, position: int) -> str:
        """The topics file this checkpoint relies on: the one on disk if no topic
        changed since it was written, else a new one named by the log position."""
        if self.topics_file is not None and self.topics_file[0] == self.topics_version:
            return self.topics_file[1]
        return f"topics-{position:020d}.jsonl"

    def topics_snapshot(self) -> list[Any]:
        """The topics part of a checkpoint, rebuilt only after a topic changed: with
        100,000 topics it is the slow part, and checkpoints hold writers at a gate."""
        version, cached = self.topics_json
        if version != self.topics_version:
            cached = [
                [
                    t.id,
                    t.namespace,
                    t.name,
                    config_to_json(t.config),
                    t.created_ms,
                    t.modified_ms,
                    len(t.queues),
                ]
                for t in self.topics.values()
            ]
            self.topics_json = (self.topics_version, cached)
        return cached

    def replay(self, position: int, size: int, record: rec.Record) -> None:
        match record:
            case rec.MessageRecord() if record.flags & rec.MESSAGE_COPY:
                self.stage_copy(position, size, record)
            case rec.MessageRecord():
                self.apply_message(position, size, record)
                self.publish(position, size, record)
            case rec.Pop():
                self.apply_pop(record)
            case rec.Ack():
                self.apply_ack(record)
            case rec.OffsetCommit():
                self.apply_offset_commit(record)
            case rec.Meta():
                self.apply_meta(record.op)
            case rec.Resolve():
                self.drop_held(record.position)
            case rec.Latest():
                self.apply_latest(record)

    def add_topic(self, topic: Topic, queue_count: int) -> None:
        topic.queues = [QueueIndex() for _ in range(queue_count)]
        self.topics[(topic.namespace, topic.name)] = topic
        self.topics_by_id[topic.id] = topic
        self.next_topic_id = max(self.next_topic_id, topic.id + 1)

    def apply_meta(self, op: dict[str, Any]) -> None:
        kind = op["op"]
        if kind.startswith("topic_"):
            self.topics_version += 1
        if kind == "ns_create":
            self.namespaces[op["ns"]] = op["ms"]
        elif kind == "ns_delete":
            self.namespaces.pop(op["ns"], None)
            for key in [k for k in self.kv if k[0] == op["ns"]]:
                del self.kv[key]
        elif kind == "topic_create":
            topic = Topic(
                op["id"], op["ns"], op["name"], topic_config(op["config"]), op["ms"], op["ms"], []
            )
            self.add_topic(topic, topic.config.queue_count)
        elif kind == "topic_alter":
            topic = self.topics_by_id[op["id"]]
            topic.config = topic_config(op["config"])
            topic.modified_ms = op["ms"]
            while len(topic.queues) < topic.config.queue_count:
                topic.queues.append(QueueIndex())
        elif kind == "topic_delete":
            topic = self.topics_by_id.pop(op["id"])
            del self.topics[(topic.namespace, topic.name)]
            self.dead_topic_ids.add(topic.id)
            for queue_key in [k for k in self.trims if k[0] == topic.id]:
                del self.trims[queue_key]
            for offsets in self.offsets.values():
                for queue_key in [k for k in offsets if k[0] == topic.id]:
                    del offsets[queue_key]
            for cursors in self.cursors.values():
                for queue_key in [k for k in cursors if k[0] == topic.id]:
                    del cursors[queue_key]
            for queue in topic.queues:
                queue.wake()
        elif kind == "trim":
            trimmed = self.topics_by_id.get(op["id"])
            if trimmed is not None and op["queue"] < len(trimmed.queues):
                queue = trimmed.queues[op["queue"]]
                queue.earliest = max(queue.earliest, min(op["offset"], queue.end))
                self.trims[(trimmed.id, op["queue"])] = queue.earliest
        elif kind == "group_config":
            self.group_configs[(op["ns"], op["group"])] = GroupConfig(**op["config"])
        elif kind == "offsets_delete":
            group_key = (op["ns"], op["group"])
            per_queue = self.offsets.get(group_key, {})
            for tid, qid in op["queues"] or list(per_queue):
                per_queue.pop((tid, qid), None)
            if not per_queue:  # a group with no offsets left is gone (Kafka's DeleteGroups)
                self.offsets.pop(group_key, None)
        elif kind == "compact":
            self.apply_compaction(op["cid"], op["id"], op["queue"], op["gaps"])
        elif kind == "kv_put":
            self.kv.setdefault((op["ns"], op["kind"]), {})[op["name"]] = op["value"]
        elif kind == "kv_delete":
            self.kv.get((op["ns"], op["kind"]), {}).pop(op["name"], None)
        else:
            raise ValueError(f"unknown metadata operation {kind!r}")

    def apply_message(self, position: int, size: int, record: rec.MessageRecord) -> None:
        """The effect of a message record on held state (publishing is separate)."""
        if record.flags & (rec.MESSAGE_SCHEDULED | rec.MESSAGE_HALF):
            topic = (
                self.topics_by_id.get(record.dispatches[0].topic_id) if record.dispatches else None
            )
            namespace = topic.namespace if topic else record.aux.partition("\x00")[0]
            held = Held(position, size, namespace, record)
            self.held[position] = held
            self.held_by_id[(namespace, record.message_id)] = position
            if record.flags & rec.MESSAGE_SCHEDULED:
                heapq.heappush(self.due, (record.due_ms, position))
                self.due_changed.set()
                delayed = self.delayed
                for d in record.dispatches:
                    key = (d.topic_id, d.queue_id)
                    delayed[key] = delayed.get(key, 0) + 1
        if record.source >= 0:  # a held message made visible (or re-held: delayed commit)
            self.drop_held(record.source)
        elif record.aux and not record.flags & rec.MESSAGE_HALF:
            self.remember(record)  # aux of a new (not half) message is its dedup key

    def stage_copy(self, position: int, size: int, record: rec.MessageRecord) -> None:
        self.staged_copies.setdefault(record.due_ms, []).append((position, size, record))

    def apply_compaction(self, cid: int, tid: int, qid: int, gaps: list[list[int]]) -> None:
        """Point the copied offsets at their copies and empty the removed ones. Gaps
        are ``[first, end)`` ranges; each gap takes the position of the offset after it
        (the compaction's own start, ``cid``, at the end), so positions stay in order
        (copies come after everything they replace) and a gap pins no old segment."""
        copies = self.staged_copies.pop(cid, [])
        topic = self.topics_by_id.get(tid)
        if topic is None or qid >= len(topic.queues):
            return  # deleted since
        queue = topic.queues[qid]
        for position, size, record in copies:
            first = record.dispatches[0].offset
            for index in range(record.count):
                offset = first + index
                if queue.base <= offset < queue.end:
                    queue.put(
                        offset,
                        IndexEntry(
                            position,
                            size,
                            index,
                            record.count,
                            record.store_ms,
                            record.group_hash,
                            record.tag_hash,
                        ),
                    )
        for start, end in reversed(gaps):
            for offset in reversed(range(max(start, queue.base), min(end, queue.end))):
                after = queue.position(offset + 1) if offset + 1 < queue.end else cid
                queue.put(offset, IndexEntry(after, 0, 0, 1, queue.store_ms(offset), 0, 0))
        # Entries changed below what the index file holds: rewrite it whole.
        queue.file_base = None
        self.dirty_queues.add((tid, qid))

    def remember(self, record: rec.MessageRecord) -> None:
        """Keep a dedup key (with what its append returned) for the dedup window."""
        expires = record.store_ms + self.dedup_window_ms
        topic = self.topics_by_id.get(record.dispatches[0].topic_id) if record.dispatches else None
        if topic is None or expires <= self.now():
            return
        key = (topic.namespace, record.aux)
        self.dedup[key] = Seen(
            expires,
            record.message_id,
            record.store_ms,
            tuple((d.topic_id, d.queue_id, d.offset) for d in record.dispatches),
        )
        self.dedup.move_to_end(key)

    def seen(self, namespace: str, dedup_key: str) -> Seen | None:
        """The append a dedup key names, if within the window. Expired keys go first:
        they were remembered in store order, so the oldest are at the front."""
        now = self.now()
        while self.dedup:
            oldest = next(iter(self.dedup.values()))
            if oldest.expires_ms > now:
                break
            self.dedup.popitem(last=False)
        return self.dedup.get((namespace, dedup_key))

    def drop_held(self, position: int) -> None:
        held = self.held.pop(position, None)
        if held is None:
            return
        self.held_by_id.pop((held.namespace, held.record.message_id), None)
        if held.record.flags & rec.MESSAGE_SCHEDULED:
            delayed = self.delayed
            for d in held.record.dispatches:
                key = (d.topic_id, d.queue_id)
                left = delayed.get(key, 0) - 1
                if left > 0:
                    delayed[key] = left
                else:
                    delayed.pop(key, None)

    def publish(self, position: int, size: int, record: rec.MessageRecord) -> None:
        """Make a durable message record visible in its queues."""
        if record.flags & (rec.MESSAGE_SCHEDULED | rec.MESSAGE_HALF):
            return
        topics_by_id, dirty = self.topics_by_id, self.dirty_queues
        for topic_id, queue_id, offset in record.dispatches:
            topic = topics_by_id.get(topic_id)
            if topic is None or queue_id >= len(topic.queues):
                continue  # deleted since
            queue = topic.queues[queue_id]
            end = queue.end
            if offset != end:
                if offset > end:
                    log.error(
                        "index gap in %s[%d]: expected offset %d, record has %d",
                        topic.name,
                        queue_id,
                        end,
                        offset,
                    )
                continue  # below: already indexed (replay over a newer index file)
            queue.append_record(
                position, size, record.count, record.store_ms, record.group_hash, record.tag_hash
            )
            dirty.add((topic_id, queue_id))
            if queue.next_offset < end + record.count:
                queue.next_offset = end + record.count
            if queue.waiters:
                queue.wake()

    def cursor(self, group: GroupKey, tid: int, qid: int) -> PopCursor:
        per_queue = self.cursors.setdefault(group, {})
        cursor = per_queue.get((tid, qid))
        if cursor is None:
            topic = self.topics_by_id.get(tid)
            start = topic.queues[qid].earliest if topic and qid < len(topic.queues) else 0
            cursor = per_queue[(tid, qid)] = PopCursor(start)
        return cursor

    def group_of(self, tid: int, group: str) -> GroupKey | None:
        topic = self.topics_by_id.get(tid)
        return (topic.namespace, group) if topic else None

    def apply_pop(self, record: rec.Pop) -> None:
        key = self.group_of(record.topic_id, record.group)
        if key is None:
            return
        self.pop_seq = max(self.pop_seq, record.seq)  # never reuse a receipt's seq
        cursor = self.cursor(key, record.topic_id, record.queue_id)
        if cursor.is_consumed(record.offset):
            return
        state = Inflight(record.deadline_ms, record.attempt, record.seq, record.first_pop_ms)
        cursor.hand_out(record.offset, state)

    def apply_ack(self, record: rec.Ack) -> None:
        key = self.group_of(record.topic_id, record.group)
        if key is not None:
            self.cursor(key, record.topic_id, record.queue_id).ack(record.offset)

    def apply_offset_commit(self, record: rec.OffsetCommit) -> None:
        key = self.group_of(record.topic_id, record.group)
        if key is not None:
            self.offsets.setdefault(key, {})[(record.topic_id, record.queue_id)] = CommittedOffset(
                offset=record.offset, metadata=record.metadata, commit_ms=record.commit_ms
            )

    def apply_latest(self, record: rec.Latest) -> None:
        values = self.latest.setdefault((record.namespace, record.topic), {})
        if record.message is None:
            values.pop(record.key, None)
        else:
            values[record.key] = record.message

    def namespace(self, namespace: str) -> str:
        if namespace not in self.namespaces:
            raise NamespaceNotFound(f"namespace {namespace!r} does not exist")
        return namespace

    def topic(self, namespace: str, name: str) -> Topic:
        topic = self.topics.get((namespace, name))
        if topic is None:
            self.namespace(namespace)
            raise TopicNotFound(f"topic {name!r} does not exist in namespace {namespace!r}")
        return topic

    def queue(self, ref: QueueRef) -> tuple[Topic, QueueIndex]:
        topic = self.topic(ref.namespace, ref.topic)
        if not 0 <= ref.queue_id < len(topic.queues):
            raise QueueNotFound(
                f"queue {ref.queue_id} does not exist in topic {ref.topic!r} "
                f"({len(topic.queues)} queues)"
            )
        return topic, topic.queues[ref.queue_id]

    def topic_info(self, topic: Topic) -> TopicInfo:
        return TopicInfo(
            namespace=topic.namespace,
            name=topic.name,
            config=topic.config,
            queues=tuple(QueueOffsets(q.earliest, q.end) for q in topic.queues),
            created_ms=topic.created_ms,
            modified_ms=topic.modified_ms,
        )

    def ref(self, key: QueueKey) -> QueueRef:
        topic = self.topics_by_id[key[0]]
        return QueueRef(topic.namespace, topic.name, key[1])
