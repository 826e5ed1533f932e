"""The embedded storage engine: the default implementation of :class:`StorageAPI`.

Layout of the data directory::

    commitlog/<position>.log   every change, framed and checksummed (commit_log.py)
    index/<topic>-<queue>.idx  per-queue offset index, persisted at checkpoints
    checkpoint.json            all other state at one log position (snapshot.py)
    node_id                    this node's id, part of every message id

How state stays correct across a crash: every change is first a commit-log record.
The in-memory state is the checkpoint plus the log replayed from the checkpoint's
position. A checkpoint is taken with writes briefly held at a gate, once everything
reserved is durable, so it describes exactly the state at its position. Readers see a
message only after its record is durable, so no crash can take back what a reader saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

from storage import batch_formats
from storage.clock import Clock, SystemClock
from storage.engine import records as rec
from storage.engine.commit_log import HEADER_SIZE, CommitLog
from storage.engine.config import Durability, EngineConfig
from storage.engine.files import fsync_directory
from storage.engine.ids import MessageIds, decode_receipt, encode_receipt, load_node_id
from storage.engine.pop_state import Inflight, PopCursor
from storage.engine.queue_index import (
    ENTRY_SIZE,
    IndexEntry,
    QueueIndex,
    load_index_file,
    write_index_file,
)
from storage.engine.snapshot import (
    iter_json_lines,
    read_snapshot,
    remove_stale,
    write_json_lines,
    write_lines,
    write_snapshot,
)
from storage.engine.state import (
    EngineState,
    Held,
    QueueKey,
    Seen,
    Topic,
    config_to_json,
    text_hash,
)
from storage.errors import (
    InvalidArgument,
    InvalidReceipt,
    MessageTooLarge,
    NamespaceAlreadyExists,
    OffsetOutOfRange,
    StorageClosed,
    StorageError,
    TopicAlreadyExists,
    TransactionNotFound,
)
from storage.model import (
    DEFAULT_NAMESPACE,
    UNLIMITED,
    AppendRequest,
    AppendResult,
    BatchEntry,
    CommittedOffset,
    GroupConfig,
    HalfMessage,
    Message,
    Placement,
    QueueOffsets,
    QueueRef,
    ReadResult,
    StoredBatch,
    StoredMessage,
    TopicConfig,
    TopicInfo,
)
from storage.names import check_name

__all__ = ["Engine"]

log = logging.getLogger(__name__)

_FIFO_SCAN_LIMIT = 4096  # offsets a FIFO pop looks ahead past blocked message groups
_YIELD_EVERY = 256  # read_batches entries decoded between two yields to the event loop
_GAP_SCAN = 65_536  # offsets a read looks past compaction's gaps for messages
_DECODED_CACHE = 64  # decoded batch entries kept for message-by-message reads
_MAX_QUEUES = 65_536
_DLQ_PREFIX = "%DLQ%"
# What undoes one hand-out of a pop: topic, queue id, offset, its seq, the state before.
_HandOut = tuple[Topic, int, int, int, Inflight | None]
# Metadata values are nested inside the checkpoint's JSON: a bound keeps every value
# readable back by a JSON parser with a recursion limit.
_MAX_META_DEPTH = 64


class Engine:
    """The embedded engine. Use as ``async with Engine(config) as engine:``."""

    def __init__(self, config: EngineConfig, *, clock: Clock | None = None) -> None:
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self._dir = Path(config.data_dir)
        self._index_dir = self._dir / "index"
        self._log = CommitLog(
            self._dir / "commitlog",
            segment_bytes=config.segment_bytes,
            durability=config.durability,
            flush_interval_ms=config.flush_interval_ms,
        )
        self._state = EngineState(dedup_window_ms=config.dedup_window_ms, clock=self.clock)
        self._rotation = 0
        self._decoded: OrderedDict[int, tuple[str, Message | BatchEntry]] = OrderedDict()
        self._ids: MessageIds | None = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._maintenance_lock = asyncio.Lock()
        self._checkpoint_position = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        self._index_dir.mkdir(exist_ok=True)
        self._ids = MessageIds(load_node_id(self._dir))
        remove_stale(self._dir, "*.tmp", keep="")  # half-written by a crash
        snapshot = read_snapshot(self._dir)
        position = 0
        if snapshot is not None:
            position = int(snapshot["position"])
            self._state.load_snapshot(
                snapshot,
                iter_json_lines(self._dir, snapshot["topics_file"]),
                iter_json_lines(self._dir, snapshot["cursors_file"]),
            )
        self._load_index_files()
        self._log.open()
        for held_position, held_size in (snapshot or {}).get("held", []):
            self._restore_held(int(held_position), int(held_size))
        replayed = 0
        for record_position, payload in self._log.recover(position):
            self._state.replay(
                record_position, HEADER_SIZE + len(payload), rec.decode_record(payload)
            )
            replayed += 1
        self._reconcile_indexes()
        self._state.staged_copies.clear()  # copies of compactions a crash cut short
        # Hand-outs of a pop with durable=False may be lost by a crash, their receipts
        # still held by clients: new hand-outs must never reuse their seqs. Starting
        # above the clock's milliseconds times 65,536 does that (a node would have to
        # hand out more than 65,536 messages per millisecond of its uptime to reach it).
        self._state.pop_seq = max(self._state.pop_seq, self._now() << 16)
        self._checkpoint_position = position
        log.info(
            "storage: opened %s at log position %d (%d records replayed)",
            self._dir,
            self._log.end,
            replayed,
        )
        self._log.start_flushing()
        self._started = True
        if DEFAULT_NAMESPACE not in self._state.namespaces:
            await self.create_namespace(DEFAULT_NAMESPACE)
        self._apply_topic_retention()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._deliver_due_loop(), name="polymq-delayed-delivery"),
            loop.create_task(self._maintenance_loop(), name="polymq-maintenance"),
        ]

    async def close(self) -> None:
        if self._closed or not self._started:
            self._closed = True
            return
        for task in (*self._tasks, *self._background):
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            await self.checkpoint()
        self._closed = True
        for topic in self._state.topics.values():
            for queue in topic.queues:
                queue.wake()
        await self._log.close()

    def _check_open(self) -> None:
        if self._closed or not self._started:
            raise StorageClosed("storage is not open")

    async def _writable(self) -> None:
        """Wait while a checkpoint holds the gate. Callers read state only after this
        returns and reserve their records without awaiting in between."""
        self._check_open()
        if not self._gate.is_set():
            await self._gate.wait()
            self._check_open()

    # ------------------------------------------------------------------ recovery

    def _load_index_files(self) -> None:
        for path in self._index_dir.glob("*.idx"):
            try:
                tid_text, qid_text = path.stem.split("-")
                topic = self._state.topics_by_id.get(int(tid_text))
                qid = int(qid_text)
            except ValueError:
                topic = None
                qid = -1
            loaded = load_index_file(path) if topic is not None else None
            if topic is None or loaded is None or qid >= len(topic.queues):
                path.unlink(missing_ok=True)
                continue
            base, entries, intact = loaded
            queue = topic.queues[qid]
            queue.base = base
            queue.file_base = base if intact else None  # torn: rewrite at the checkpoint
            if not intact:
                self._state.dirty_queues.add((topic.id, qid))
            queue.entries = entries
            queue.next_offset = queue.persisted_end = queue.end
        for path in self._index_dir.glob("*.tmp"):
            path.unlink(missing_ok=True)

    def _reconcile_indexes(self) -> None:
        """Cut index entries that point past the log end or before its start."""
        start, end = self._log.start, self._log.end
        for topic in self._state.topics.values():
            for queue in topic.queues:
                if queue.end > queue.base and queue.position(queue.end - 1) >= end:
                    queue.truncate(queue.first_offset_where("position", end))
                if queue.end > queue.base and queue.position(queue.base) < start:
                    queue.trim_to(queue.first_offset_where("position", start))
                queue.earliest = min(max(queue.earliest, queue.base), queue.end)
                queue.next_offset = queue.end

    def _restore_held(self, position: int, size: int) -> None:
        record = rec.decode_record(self._log.read(position, size))
        if isinstance(record, rec.MessageRecord):
            self._state.replay(position, size, record)

    # ------------------------------------------------------------------ applying records

    def _record(self, record: rec.Record) -> int:
        """Reserve a non-message record; its in-memory effect is applied by the caller."""
        return self._log.reserve(rec.encode_record(record))

    def _meta(self, **op: Any) -> int:
        """Log and apply one metadata change; returns the log end to wait for."""
        self._state.apply_meta(op)
        self._record(rec.Meta(op))
        return self._log.end

    def _create_topic_now(self, namespace: str, name: str, config: TopicConfig) -> Topic:
        self._meta(
            op="topic_create",
            id=self._state.next_topic_id,
            ns=namespace,
            name=name,
            config=config_to_json(config),
            ms=self._now(),
        )
        return self._state.topics[(namespace, name)]

    def _ack_now(self, group: str, topic_id: int, queue_id: int, offset: int) -> None:
        """Log and apply an ack, through the same function a replay uses."""
        record = rec.Ack(group, topic_id, queue_id, offset)
        self._state.apply_ack(record)
        self._record(record)

    def _hand_out_now(
        self, group: str, topic_id: int, queue_id: int, offset: int, state: Inflight
    ) -> None:
        """Log and apply a hand-out (a pop or a new invisibility), as a replay would."""
        record = rec.Pop(
            group,
            topic_id,
            queue_id,
            offset,
            state.deadline_ms,
            state.attempt,
            state.seq,
            state.first_pop_ms,
        )
        self._state.apply_pop(record)
        self._record(record)

    # ------------------------------------------------------------------ lookups

    def _now(self) -> int:
        return self.clock.now_ms()

    # ------------------------------------------------------------------ namespaces

    async def create_namespace(self, namespace: str) -> None:
        check_name("namespace", namespace)
        await self._writable()
        if namespace in self._state.namespaces:
            raise NamespaceAlreadyExists(f"namespace {namespace!r} already exists")
        await self._log.wait_durable(self._meta(op="ns_create", ns=namespace, ms=self._now()))

    async def delete_namespace(self, namespace: str) -> None:
        await self._writable()
        self._state.namespace(namespace)
        if any(ns == namespace for ns, _ in self._state.topics):
            raise InvalidArgument(f"namespace {namespace!r} still has topics")
        await self._log.wait_durable(self._meta(op="ns_delete", ns=namespace))

    async def list_namespaces(self) -> list[str]:
        self._check_open()
        return sorted(self._state.namespaces)

    # ------------------------------------------------------------------ topics

    @staticmethod
    def _check_topic_config(config: TopicConfig) -> None:
        if not 1 <= config.queue_count <= _MAX_QUEUES:
            raise InvalidArgument(f"queue_count must be 1..{_MAX_QUEUES}, got {config.queue_count}")
        for name in ("retention_ms", "retention_bytes"):
            value = getattr(config, name)
            if value is not None and value <= 0 and value != UNLIMITED:
                raise InvalidArgument(f"{name} must be positive or {UNLIMITED}, got {value}")
        if config.max_message_bytes is not None and config.max_message_bytes <= 0:
            raise InvalidArgument(
                f"max_message_bytes must be positive, got {config.max_message_bytes}"
            )

    async def create_topic(
        self, namespace: str, topic: str, config: TopicConfig = TopicConfig()
    ) -> TopicInfo:
        check_name("topic", topic)
        self._check_topic_config(config)
        await self._writable()
        self._state.namespace(namespace)
        if (namespace, topic) in self._state.topics:
            raise TopicAlreadyExists(f"topic {topic!r} already exists in namespace {namespace!r}")
        created = self._create_topic_now(namespace, topic, config)
        await self._log.wait_durable()
        return self._state.topic_info(created)

    async def alter_topic(self, namespace: str, topic: str, config: TopicConfig) -> TopicInfo:
        self._check_topic_config(config)
        await self._writable()
        current = self._state.topic(namespace, topic)
        if config.queue_count < len(current.queues):
            raise InvalidArgument(
                f"queue_count can only grow: topic {topic!r} has {len(current.queues)} queues"
            )
        end = self._meta(
            op="topic_alter", id=current.id, config=config_to_json(config), ms=self._now()
        )
        await self._log.wait_durable(end)
        self._apply_topic_retention()
        return self._state.topic_info(current)

    async def delete_topic(self, namespace: str, topic: str) -> None:
        await self._writable()
        current = self._state.topic(namespace, topic)
        await self._log.wait_durable(self._meta(op="topic_delete", id=current.id))

    async def list_topics(
        self, namespace: str, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        self._check_open()
        self._state.namespace(namespace)
        return [
            self._state.topic_info(t)
            for (ns, _), t in sorted(self._state.topics.items())
            if ns == namespace and (include_internal or not t.config.internal)
        ]

    async def describe_topic(self, namespace: str, topic: str) -> TopicInfo:
        self._check_open()
        return self._state.topic_info(self._state.topic(namespace, topic))

    async def queue_offsets(self, queue: QueueRef) -> QueueOffsets:
        self._check_open()
        _, index = self._state.queue(queue)
        return QueueOffsets(index.earliest, index.end)

    async def delete_records(self, queue: QueueRef, before_offset: int) -> QueueOffsets:
        await self._writable()
        topic, index = self._state.queue(queue)
        if not 0 <= before_offset <= index.end:
            raise OffsetOutOfRange(
                f"offset {before_offset} is outside [0, {index.end}] of {queue}",
                earliest=index.earliest,
                latest=index.end,
            )
        if before_offset > index.earliest:
            end = self._meta(op="trim", id=topic.id, queue=queue.queue_id, offset=before_offset)
            await self._log.wait_durable(end)
        return QueueOffsets(index.earliest, index.end)

    async def compact(
        self,
        queue: QueueRef,
        drop: Sequence[int] = (),
        rewrite: Mapping[int, BatchEntry] | None = None,
    ) -> int:
        """See :meth:`storage.api.StorageAPI.compact`.

        Crash safety by ordering: the copies are written first as staged records that
        change nothing by themselves, then one closing "compact" record applies them
        with the gaps. A crash before the closing record is durable leaves the queue
        as it was; after, the replay applies the same change. The old records are then
        referenced by no index entry and go with their segments under retention.

        Positions must stay in offset order along the queue (retention and recovery
        binary-search them), so every entry from the first changed offset to the end
        is copied, and no append may be half-done meanwhile: writers are held at the
        gate while the copies are reserved, as a checkpoint holds them.
        """
        await self._writable()
        _, index = self._state.queue(queue)
        asked = [*drop, *(rewrite or {})]
        if asked and (max(asked) >= index.end or min(asked) < 0):
            raise InvalidArgument(f"compaction of {queue} names offsets outside [0, {index.end})")
        async with self._maintenance_lock:
            self._gate.clear()
            try:
                await self._log.wait_durable()  # every reserved append is indexed now
                self._check_open()
                topic, index = self._state.queue(queue)  # retention may have trimmed it
                dropped = {o for o in drop if o >= index.base}
                replaced = {o: e for o, e in (rewrite or {}).items() if o >= index.base}
                if not dropped and not replaced:
                    return 0
                end, emptied = self._compact_now(topic, queue.queue_id, index, dropped, replaced)
            finally:
                self._gate.set()
        await self._log.wait_durable(end)
        return emptied

    def _compact_now(
        self,
        topic: Topic,
        queue_id: int,
        index: QueueIndex,
        dropped: set[int],
        rewrite: dict[int, BatchEntry],
    ) -> tuple[int, int]:
        """Reserve the copies and the closing record; returns the log end to wait for
        and how many offsets become gaps. Synchronous: nothing is appended between."""
        first = min(o for o in (*dropped, *rewrite) if o >= index.base)
        first -= index.get(first).batch_index  # from the start of its entry
        first = max(first, index.base)
        copies: list[tuple[int, IndexEntry, bytes | None]] = []  # base, entry, new entry
        gaps: set[int] = set()  # new and earlier ones: all get positions in order again
        emptied = 0
        offset = first
        while offset < index.end:
            entry = index.get(offset)
            if not entry.size:
                gaps.add(offset)
                offset += 1
                continue
            base = offset - entry.batch_index
            span = range(max(base, index.base), base + entry.batch_count)
            present = [o for o in span if index.get(o).size]
            going = [o for o in present if o in dropped]
            replacement = rewrite.pop(base, None)
            if replacement is not None:
                if replacement.size != entry.batch_count:
                    raise InvalidArgument(
                        f"offset {base} of {topic.name}[{queue_id}] starts an entry of "
                        f"{entry.batch_count} offsets, not {replacement.size}"
                    )
                copies.append((base, entry, rec.encode_entry(replacement)))
            elif len(going) < len(present):
                if going:
                    raise InvalidArgument(
                        f"offsets {span.start}-{span.stop - 1} of {topic.name}[{queue_id}] "
                        "are one entry: drop all of them or rewrite it"
                    )
                copies.append((base, entry, None))
            emptied += len(going)
            gaps.update(o for o in span if o in dropped or o not in present)
            offset = span.stop
        if rewrite:
            raise InvalidArgument(f"offsets {sorted(rewrite)} start no entry")
        cid = self._log.end
        spans = [(entry.position, entry.size) for _, entry, new in copies if new is None]
        payloads = iter(self._log.read_many(spans)) if spans else iter(())
        for base, entry, new in copies:
            original = rec.decode_record(next(payloads)) if new is None else None
            assert original is None or isinstance(original, rec.MessageRecord)
            record = rec.MessageRecord(
                flags=rec.MESSAGE_COPY,
                store_ms=entry.store_ms,
                message_id=original.message_id if original else self._message_id_at(entry),
                source=-1,
                count=entry.batch_count,
                due_ms=cid,
                group_hash=entry.group_hash,
                tag_hash=entry.tag_hash,
                dispatches=(rec.Dispatch(topic.id, queue_id, base),),
                aux="",
                entry=original.entry if original else (new or b""),
            )
            payload = rec.encode_record(record)
            position = self._log.reserve(payload)
            self._state.stage_copy(position, HEADER_SIZE + len(payload), record)
        ranges = _ranges(sorted(gaps))
        op = {"op": "compact", "cid": cid, "id": topic.id, "queue": queue_id, "gaps": ranges}
        self._log.reserve(
            rec.encode_record(rec.Meta(op)),
            on_durable=lambda: self._state.apply_compaction(cid, topic.id, queue_id, ranges),
        )
        return self._log.end, emptied

    def _message_id_at(self, entry: IndexEntry) -> str:
        message_id, _ = rec.read_message_entry(self._log.read(entry.position, entry.size))
        return message_id

    async def offset_for_timestamp(self, queue: QueueRef, timestamp_ms: int) -> int:
        self._check_open()
        _, index = self._state.queue(queue)
        return max(index.earliest, index.first_offset_where("store_ms", timestamp_ms))

    # ------------------------------------------------------------------ append

    def _max_bytes(self, topic: Topic) -> int:
        limit = self.config.max_message_bytes
        if topic.config.max_message_bytes is not None:
            limit = min(limit, topic.config.max_message_bytes)
        return limit

    def _validate_append(self, request: AppendRequest) -> list[tuple[Topic, int]]:
        if request.dedup_key is not None:
            check_name("dedup key", request.dedup_key)
        if not isinstance(request.entry, Message | BatchEntry):
            raise InvalidArgument("entry must be a Message or a BatchEntry")
        if not request.queues:
            raise InvalidArgument("an append needs at least one queue")
        if len(request.queues) > 1 and len(set(request.queues)) != len(request.queues):
            raise InvalidArgument("the same queue appears twice in one append")
        targets = []
        topic: Topic | None = None
        for ref in request.queues:
            if topic is not None and ref.topic == topic.name and ref.namespace == topic.namespace:
                if not 0 <= ref.queue_id < len(topic.queues):  # a fan-out within one topic
                    self._state.queue(ref)  # raises QueueNotFound
            else:
                topic, _ = self._state.queue(ref)
            targets.append((topic, ref.queue_id))
        entry = request.entry
        size = len(entry.body) if isinstance(entry, Message) else len(entry.raw)
        if isinstance(entry, BatchEntry):
            if entry.messages and entry.count not in (0, len(entry.messages)):
                raise InvalidArgument("a batch entry's count does not match its messages")
            if not entry.messages and not batch_formats.is_registered(entry.format):
                raise InvalidArgument(
                    f"a batch entry of unregistered format {entry.format!r} needs its messages"
                )
            if not 1 <= entry.size <= 0xFFFF:
                raise InvalidArgument("a batch entry spans 1 to 65535 offsets")
            size = max(size, sum(len(m.body) for m in entry.messages))
            now = self._now()
            if any((m.delivery_time_ms or 0) > now for m in entry.messages):
                raise InvalidArgument("batch entries cannot be delayed; append messages singly")
        limit = min(self._max_bytes(topic) for topic, _ in targets)
        if size > limit:
            raise MessageTooLarge(f"message of {size} bytes is over the limit of {limit} bytes")
        return targets

    def _append_now(
        self,
        entry: Message | BatchEntry,
        targets: Sequence[tuple[Topic, int]],
        *,
        encoded: bytes | None = None,
        message_id: str | None = None,
        flags: int = 0,
        source: int = -1,
        aux: str = "",
    ) -> tuple[rec.MessageRecord, int]:
        """Reserve one message record; offsets are assigned now and become readable when
        it is durable. Synchronous: no other task runs between check and reserve."""
        assert self._ids is not None
        # Encoded before any offset is reserved: a value the record format cannot hold
        # (a timestamp past int64) must fail the append, not leave an index gap.
        if encoded is None:
            try:
                encoded = rec.encode_entry(entry)
            except (struct.error, OverflowError) as e:
                raise InvalidArgument(f"message cannot be stored: {e}") from e
        now = self._now()
        if isinstance(entry, Message):
            first: Message | None = entry
            count = 1
        else:
            first = entry.messages[0] if entry.messages else None
            count = entry.size
        due = (first.delivery_time_ms or 0) if first is not None else 0
        if not flags and isinstance(entry, Message) and due > now:
            flags = rec.MESSAGE_SCHEDULED
        held = bool(flags & (rec.MESSAGE_SCHEDULED | rec.MESSAGE_HALF))
        dispatches = []
        for topic, qid in targets:
            if held:
                offset = -1
            else:
                queue = topic.queues[qid]
                offset = queue.next_offset
                queue.next_offset += count
            dispatches.append(rec.Dispatch(topic.id, qid, offset))
        record = rec.MessageRecord(
            flags=flags,
            store_ms=now,
            message_id=message_id or self._ids.next(now),
            source=source,
            count=count,
            due_ms=due,
            group_hash=text_hash(first.message_group) if first is not None else 0,
            tag_hash=text_hash(first.tag) if first is not None else 0,
            dispatches=tuple(dispatches),
            aux=aux,
            entry=encoded,
        )
        payload = rec.encode_record(record)
        size = HEADER_SIZE + len(payload)
        position = self._log.reserve(
            payload, on_durable=lambda: self._state.publish(position, size, record)
        )
        self._state.apply_message(position, size, record)
        return record, position

    @staticmethod
    def _result(record: rec.MessageRecord, queues: Sequence[QueueRef]) -> AppendResult:
        """``queues`` are the refs the record was dispatched to, in dispatch order."""
        placements = tuple(
            Placement(ref, d.offset)
            for ref, d in zip(queues, record.dispatches, strict=True)
            if d.offset >= 0
        )
        return AppendResult(
            message_id=record.message_id,
            store_timestamp_ms=record.store_ms,
            placements=placements,
        )

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        await self._writable()
        checked = [(r, self._validate_append(r)) for r in requests]
        done: list[rec.MessageRecord | AppendResult] = []
        for request, targets in checked:
            seen = (
                self._state.seen(request.queues[0].namespace, request.dedup_key)
                if request.dedup_key is not None
                else None
            )
            if seen is not None:
                done.append(self._duplicate(seen))
            else:
                done.append(
                    self._append_now(
                        request.entry,
                        targets,
                        aux=request.dedup_key or "",
                        message_id=request.message_id,
                    )[0]
                )
        await self._log.wait_durable()
        return [
            item if isinstance(item, AppendResult) else self._result(item, request.queues)
            for item, (request, _) in zip(done, checked, strict=True)
        ]

    def _duplicate(self, seen: Seen) -> AppendResult:
        placements = tuple(
            Placement(self._state.ref((tid, qid)), offset)
            for tid, qid, offset in seen.dispatches
            if offset >= 0 and tid in self._state.topics_by_id
        )
        return AppendResult(
            message_id=seen.message_id,
            store_timestamp_ms=seen.store_ms,
            placements=placements,
            duplicate=True,
        )

    async def cancel_delayed(self, namespace: str, message_id: str) -> bool:
        await self._writable()
        position = self._state.held_by_id.get((namespace, message_id))
        held = self._state.held.get(position) if position is not None else None
        if held is None or held.is_half:
            return False
        self._state.drop_held(held.position)
        self._record(rec.Resolve(held.position, rec.RESOLVE_CANCEL))
        await self._log.wait_durable()
        return True

    # ------------------------------------------------------------------ delayed delivery

    async def _deliver_due_loop(self) -> None:
        while True:
            now = self._now()
            while self._state.due and (self._state.due[0][1] not in self._state.held):
                heapq.heappop(self._state.due)
            if self._state.due and self._state.due[0][0] <= now:
                await self._writable()
                while self._state.due and self._state.due[0][0] <= self._now():
                    _, position = heapq.heappop(self._state.due)
                    held = self._state.held.get(position)
                    if held is not None:
                        self._make_visible(held)
                continue
            self._state.due_changed.clear()
            waiters: list[asyncio.Future[Any]] = [
                asyncio.ensure_future(self._state.due_changed.wait())
            ]
            if self._state.due:
                waiters.append(asyncio.ensure_future(self.clock.sleep_until(self._state.due[0][0])))
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    def _make_visible(self, held: Held) -> rec.MessageRecord:
        """Append a visible copy of a held message (same id and body) into its queues."""
        targets = []
        for d in held.record.dispatches:
            topic = self._state.topics_by_id.get(d.topic_id)
            if topic is not None and d.queue_id < len(topic.queues):
                targets.append((topic, d.queue_id))
        entry = rec.decode_entry(held.record.entry)
        record, _ = self._append_now(
            entry,
            targets,
            encoded=held.record.entry,
            message_id=held.record.message_id,
            flags=0,
            source=held.position,
        )
        return record

    # ------------------------------------------------------------------ reading

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
            if len(self._decoded) > _DECODED_CACHE:
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

    def _messages_at(self, entries: Sequence[IndexEntry]) -> list[tuple[Message, str]]:
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

    def _stored(self, ref: QueueRef, queue: QueueIndex, offset: int, **extra: Any) -> StoredMessage:
        entry = queue.get(offset)
        [(message, message_id)] = self._messages_at([entry])
        return StoredMessage(
            message=message,
            queue=ref,
            offset=offset,
            message_id=message_id,
            store_timestamp_ms=entry.store_ms,
            **extra,
        )

    async def _wait_for_data(
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
        sleeper = asyncio.ensure_future(self.clock.sleep_until(until))
        try:
            await asyncio.wait([future, sleeper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            future.cancel()
            for queue in watched:
                if queue.waiters and future in queue.waiters:
                    queue.waiters.remove(future)

    async def _readable(self, ref: QueueRef, offset: int, wait_ms: int) -> QueueIndex:
        """The queue's index once ``offset`` is valid, after a long poll if it is the end
        (or only compaction's gaps lie between it and the end)."""
        self._check_open()
        _, index = self._state.queue(ref)
        self._check_offset(ref, index, offset)
        if wait_ms > 0 and _nothing_from(index, offset):
            await self._wait_for_data([index], self._now() + wait_ms)
            self._check_open()
            _, index = self._state.queue(ref)  # the topic may be gone by now
            self._check_offset(ref, index, offset)
        return index

    def _check_offset(self, ref: QueueRef, queue: QueueIndex, offset: int) -> None:
        if offset < queue.earliest or offset > queue.end:
            raise OffsetOutOfRange(
                f"offset {offset} is outside [{queue.earliest}, {queue.end}] of {ref}",
                earliest=queue.earliest,
                latest=queue.end,
            )

    async def read(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = 32,
        max_bytes: int = 1 << 20,
        wait_ms: int = 0,
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
        loaded = self._messages_at([e for _, e in entries])
        for (current, entry), (message, message_id) in zip(entries, loaded, strict=True):
            total += len(message.body)
            if messages and total > max_bytes:
                next_offset = current
                break
            messages.append(
                StoredMessage(
                    message=message,
                    queue=queue,
                    offset=current,
                    message_id=message_id,
                    store_timestamp_ms=entry.store_ms,
                )
            )
        return ReadResult(
            messages=tuple(messages),
            next_offset=next_offset,
            offsets=QueueOffsets(index.earliest, index.end),
        )

    async def read_batches(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_bytes: int = 1 << 20,
        wait_ms: int = 0,
    ) -> list[StoredBatch]:
        index = await self._readable(queue, offset, wait_ms)
        batches: list[StoredBatch] = []
        total = 0
        current = offset
        while current < index.end:
            if batches and len(batches) % _YIELD_EVERY == 0:
                # Thousands of small messages fit in max_bytes: let other tasks run.
                await asyncio.sleep(0)
                self._check_open()
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
                stored = StoredMessage(
                    message=decoded,
                    queue=queue,
                    offset=current,
                    message_id=message_id,
                    store_timestamp_ms=entry.store_ms,
                )
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

    # ------------------------------------------------------------------ offsets (stream mode)

    def _queue_key(self, namespace: str, ref: QueueRef) -> QueueKey:
        if ref.namespace != namespace:
            raise InvalidArgument(f"queue {ref} is not in namespace {namespace!r}")
        topic, _ = self._state.queue(ref)
        return topic.id, ref.queue_id

    async def commit_offset(
        self, namespace: str, group: str, queue: QueueRef, offset: int, metadata: str = ""
    ) -> None:
        check_name("group", group)
        await self._writable()
        tid, qid = self._queue_key(namespace, queue)
        if offset < 0:
            raise InvalidArgument(f"offset must not be negative, got {offset}")
        record = rec.OffsetCommit(group, tid, qid, offset, metadata, self._now())
        self._state.apply_offset_commit(record)
        self._record(record)
        await self._log.wait_durable()

    async def fetch_offset(
        self, namespace: str, group: str, queue: QueueRef
    ) -> CommittedOffset | None:
        self._check_open()
        key = self._queue_key(namespace, queue)
        return self._state.offsets.get((namespace, group), {}).get(key)

    async def list_group_offsets(
        self, namespace: str, group: str
    ) -> dict[QueueRef, CommittedOffset]:
        self._check_open()
        return {
            self._state.ref(k): v
            for k, v in self._state.offsets.get((namespace, group), {}).items()
        }

    async def delete_group_offsets(
        self, namespace: str, group: str, queues: Sequence[QueueRef] | None = None
    ) -> None:
        await self._writable()
        keys = None if queues is None else [list(self._queue_key(namespace, q)) for q in queues]
        await self._log.wait_durable(
            self._meta(op="offsets_delete", ns=namespace, group=group, queues=keys)
        )

    async def list_groups(self, namespace: str) -> list[str]:
        self._check_open()
        names = {
            g
            for source in (self._state.offsets, self._state.cursors, self._state.group_configs)
            for ns, g in source
            if ns == namespace
        }
        return sorted(names)

    # ------------------------------------------------------------------ pop mode

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None:
        check_name("group", group)
        if config.max_delivery_attempts is not None and config.max_delivery_attempts < 1:
            raise InvalidArgument("max_delivery_attempts must be at least 1")
        if config.dead_letter_topic is not None:
            check_name("topic", config.dead_letter_topic)
        await self._writable()
        self._state.namespace(namespace)
        end = self._meta(
            op="group_config", ns=namespace, group=group, config=config_to_json(config)
        )
        await self._log.wait_durable(end)

    async def get_group_config(self, namespace: str, group: str) -> GroupConfig:
        self._check_open()
        return self._state.group_configs.get((namespace, group), GroupConfig())

    def _pop_candidates(
        self, cursor: PopCursor, queue: QueueIndex, fifo: bool, now: int
    ) -> Iterator[int]:
        """Offsets that may be handed out now, in order of preference."""
        if cursor.done_below < queue.earliest:
            cursor.skip_to(queue.earliest)
        if not fifo:
            yield from cursor.expired(now)
            yield from range(max(cursor.next_new, queue.earliest), queue.end)
            return
        blocked: set[int] = set()
        stop = min(queue.end, cursor.done_below + _FIFO_SCAN_LIMIT)
        for offset in range(cursor.done_below, stop):
            if cursor.is_consumed(offset):  # done_below moves while this runs
                continue
            group_hash = queue.get(offset).group_hash
            state = cursor.inflight.get(offset)
            if state is not None and state.deadline_ms > now:
                if group_hash:  # messages without a group carry no order
                    blocked.add(group_hash)
                continue
            if group_hash in blocked:
                continue
            if group_hash:
                blocked.add(group_hash)
            yield offset
            if cursor.is_consumed(offset):  # filtered, expired or dead-lettered
                blocked.discard(group_hash)

    async def pop(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int = 1,
        invisible_ms: int = 30_000,
        wait_ms: int = 0,
        tags: frozenset[str] | None = None,
        durable: bool = True,
    ) -> list[StoredMessage]:
        check_name("group", group)
        if max_messages < 1:
            raise InvalidArgument("max_messages must be at least 1")
        if invisible_ms < 0:
            raise InvalidArgument("invisible_ms must not be negative")
        if not queues:
            raise InvalidArgument("pop needs at least one queue")
        deadline = self._now() + max(0, wait_ms)
        while True:
            await self._writable()
            targets = [(ref, *self._state.queue(ref)) for ref in queues]
            for ref, _, _ in targets:
                self._queue_key(namespace, ref)
            handed: list[_HandOut] = []
            popped, end = self._pop_now(
                namespace, group, targets, max_messages, invisible_ms, tags, handed
            )
            if popped or self._now() >= deadline:
                if end is not None:
                    try:
                        if durable:
                            await self._log.wait_durable(end)
                        else:
                            await self._log.wait_written(end)
                    except asyncio.CancelledError:
                        with contextlib.suppress(StorageError):  # a failed log: moot
                            self._give_back(namespace, group, handed)
                        raise
                return popped
            if end is not None:
                await self._log.wait_durable(end)  # consumed silently: filtered or expired
            wake_at = self._next_redelivery(namespace, group, targets)
            await self._wait_for_data([q for _, _, q in targets], deadline, wake_at)

    def _give_back(self, namespace: str, group: str, handed: list[_HandOut]) -> None:
        """A pop cancelled after it handed messages out (while it waited for their
        hand-out records): nobody got them, so they are visible again at once, with
        their attempt as before, instead of staying invisible for ``invisible_ms``."""
        if not handed or self._closed:
            return
        if not self._gate.is_set():
            # A checkpoint holds writers (or storage closes): no record may be reserved
            # now. Give back as soon as the gate opens, unless storage is gone.
            async def later() -> None:
                with contextlib.suppress(StorageError):
                    await self._writable()
                    self._give_back(namespace, group, handed)

            task = asyncio.get_running_loop().create_task(later(), name="polymq-give-back")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        now = self._now()
        woken: set[QueueIndex] = set()
        for topic, queue_id, offset, seq, previous in handed:
            if self._state.topics_by_id.get(topic.id) is not topic:
                continue  # deleted since
            cursor = self._state.cursors.get((namespace, group), {}).get((topic.id, queue_id))
            state = cursor.inflight.get(offset) if cursor is not None else None
            if state is None or state.seq != seq:
                continue  # acked or handed out again since (invisible_ms 0)
            # Due now, with the attempt it had: the next pop counts this one again.
            attempt = previous.attempt if previous is not None else 0
            first_pop = previous.first_pop_ms if previous is not None else state.first_pop_ms
            restored = Inflight(now, attempt, self._state.pop_seq + 1, first_pop)
            self._hand_out_now(group, topic.id, queue_id, offset, restored)
            woken.add(topic.queues[queue_id])
        for queue in woken:
            queue.wake()

    def _next_redelivery(
        self, namespace: str, group: str, targets: list[tuple[QueueRef, Topic, QueueIndex]]
    ) -> int | None:
        """When the earliest in-flight message of these queues becomes visible again."""
        cursors = self._state.cursors.get((namespace, group), {})
        deadlines = [
            deadline
            for ref, topic, _ in targets
            if (cursor := cursors.get((topic.id, ref.queue_id))) is not None
            and (deadline := cursor.next_deadline()) is not None
        ]
        return min(deadlines, default=None)

    def _pop_now(
        self,
        namespace: str,
        group: str,
        targets: list[tuple[QueueRef, Topic, QueueIndex]],
        max_messages: int,
        invisible_ms: int,
        tags: frozenset[str] | None,
        handed: list[_HandOut],
    ) -> tuple[list[StoredMessage], int | None]:
        """Hand out what is visible; ``handed`` gets what :meth:`_give_back` needs to
        undo each hand-out."""
        config = self._state.group_configs.get((namespace, group), GroupConfig())
        tag_hashes = None if tags is None or "*" in tags else {text_hash(t) for t in tags}
        now = self._now()
        popped: list[StoredMessage] = []
        logged = False
        self._rotation += 1
        start = self._rotation % len(targets)
        for ref, topic, queue in targets[start:] + targets[:start]:
            if len(popped) >= max_messages:
                break
            cursor = self._state.cursor((namespace, group), topic.id, ref.queue_id)
            for offset in self._pop_candidates(cursor, queue, config.fifo, now):
                entry = queue.get(offset)
                if not entry.size:  # a gap left by compaction: nothing to hand out
                    self._ack_now(group, topic.id, ref.queue_id, offset)
                    logged = True
                    continue
                [(message, message_id)] = self._messages_at([entry])
                previous = cursor.inflight.get(offset)
                attempt = previous.attempt + 1 if previous else 1
                consumed = (tag_hashes is not None and entry.tag_hash not in tag_hashes) or (
                    message.expiry_ms is not None and message.expiry_ms <= now
                )
                limit = config.max_delivery_attempts
                if not consumed and limit is not None and attempt > limit:
                    self._dead_letter(
                        namespace, group, config, ref, offset, message, message_id, attempt - 1
                    )
                    consumed = True
                logged = True
                if consumed:
                    self._ack_now(group, topic.id, ref.queue_id, offset)
                    continue
                first_pop = previous.first_pop_ms if previous else now
                state = Inflight(now + invisible_ms, attempt, self._state.pop_seq + 1, first_pop)
                self._hand_out_now(group, topic.id, ref.queue_id, offset, state)
                handed.append((topic, ref.queue_id, offset, state.seq, previous))
                popped.append(
                    StoredMessage(
                        message=message,
                        queue=ref,
                        offset=offset,
                        message_id=message_id,
                        store_timestamp_ms=entry.store_ms,
                        delivery_attempt=attempt,
                        receipt=encode_receipt(topic.id, ref.queue_id, offset, state.seq),
                        first_pop_ms=first_pop,
                        next_visible_ms=state.deadline_ms,
                    )
                )
                if len(popped) >= max_messages:
                    break
        return popped, (self._log.end if logged else None)

    def _dead_letter(
        self,
        namespace: str,
        group: str,
        config: GroupConfig,
        origin: QueueRef,
        offset: int,
        message: Message,
        message_id: str,
        attempts: int,
    ) -> None:
        if not config.dead_letter:
            return
        name = config.dead_letter_topic or f"{_DLQ_PREFIX}{group}"
        topic = self._state.topics.get((namespace, name))
        if topic is None:
            topic = self._create_topic_now(namespace, name, TopicConfig())
        properties = (
            *message.properties,
            ("DLQ_ORIGIN_TOPIC", origin.topic.encode()),
            ("DLQ_ORIGIN_QUEUE_ID", str(origin.queue_id).encode()),
            ("DLQ_ORIGIN_OFFSET", str(offset).encode()),
            ("DLQ_ORIGIN_MESSAGE_ID", message_id.encode()),
            ("DLQ_DELIVERY_ATTEMPTS", str(attempts).encode()),
            ("DLQ_GROUP", group.encode()),
        )
        dead = replace(message, properties=properties, delivery_time_ms=None)
        self._append_now(dead, [(topic, 0)], message_id=message_id)
        log.info("moved %s offset %d to %s after %d deliveries", origin, offset, name, attempts)

    def _inflight_for(
        self, namespace: str, group: str, receipt: str
    ) -> tuple[Topic, int, int, PopCursor, Inflight]:
        tid, qid, offset, seq = decode_receipt(receipt)
        topic = self._state.topics_by_id.get(tid)
        if topic is None or topic.namespace != namespace or qid >= len(topic.queues):
            raise InvalidReceipt("receipt handle does not name a queue of this namespace")
        cursor = self._state.cursors.get((namespace, group), {}).get((tid, qid))
        state = cursor.inflight.get(offset) if cursor else None
        if cursor is None or state is None or state.seq != seq:
            raise InvalidReceipt(
                "receipt handle is stale: the message was acked or handed out again since"
            )
        return topic, qid, offset, cursor, state

    async def ack(self, namespace: str, group: str, receipt: str) -> None:
        await self._writable()
        topic, qid, offset, _, _ = self._inflight_for(namespace, group, receipt)
        self._ack_now(group, topic.id, qid, offset)
        if self._is_fifo(namespace, group):
            topic.queues[qid].wake()
        await self._log.wait_durable()

    def _is_fifo(self, namespace: str, group: str) -> bool:
        """In a FIFO group an ack releases the next message of its message group, so
        pops waiting on the queue must look again; otherwise an ack frees nothing."""
        return self._state.group_configs.get((namespace, group), GroupConfig()).fifo

    async def ack_many(
        self, namespace: str, group: str, receipts: Sequence[str]
    ) -> list[str | None]:
        await self._writable()
        outcomes: list[str | None] = []
        acked: set[QueueIndex] = set()
        for receipt in receipts:
            try:
                topic, qid, offset, _, _ = self._inflight_for(namespace, group, receipt)
            except InvalidReceipt as exc:
                outcomes.append(exc.code)
                continue
            self._ack_now(group, topic.id, qid, offset)
            acked.add(topic.queues[qid])
            outcomes.append(None)
        if self._is_fifo(namespace, group):
            for queue in acked:
                queue.wake()
        await self._log.wait_durable()
        return outcomes

    async def change_invisibility(
        self, namespace: str, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        if invisible_ms < 0:
            raise InvalidArgument("invisible_ms must not be negative")
        await self._writable()
        topic, qid, offset, _, state = self._inflight_for(namespace, group, receipt)
        new = Inflight(
            self._now() + invisible_ms, state.attempt, self._state.pop_seq + 1, state.first_pop_ms
        )
        self._hand_out_now(group, topic.id, qid, offset, new)
        # A pop waiting on this queue computed its wake-up from the old deadline.
        topic.queues[qid].wake()
        await self._log.wait_durable()
        ref = QueueRef(topic.namespace, topic.name, qid)
        return self._stored(
            ref,
            topic.queues[qid],
            offset,
            delivery_attempt=new.attempt,
            receipt=encode_receipt(topic.id, qid, offset, new.seq),
            first_pop_ms=new.first_pop_ms,
            next_visible_ms=new.deadline_ms,
        )

    async def nack(self, namespace: str, group: str, receipt: str, *, delay_ms: int = 0) -> None:
        await self.change_invisibility(namespace, group, receipt, delay_ms)

    async def dead_letter(self, namespace: str, group: str, receipt: str) -> None:
        await self._writable()
        topic, qid, offset, _, state = self._inflight_for(namespace, group, receipt)
        ref = QueueRef(topic.namespace, topic.name, qid)
        [(message, message_id)] = self._messages_at([topic.queues[qid].get(offset)])
        config = self._state.group_configs.get((namespace, group), GroupConfig())
        self._dead_letter(namespace, group, config, ref, offset, message, message_id, state.attempt)
        self._ack_now(group, topic.id, qid, offset)
        if self._is_fifo(namespace, group):
            topic.queues[qid].wake()
        await self._log.wait_durable()

    async def inflight_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        self._check_open()
        key = self._queue_key(namespace, queue)
        cursor = self._state.cursors.get((namespace, group), {}).get(key)
        return len(cursor.inflight) if cursor else 0

    async def pending_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        self._check_open()
        key = self._queue_key(namespace, queue)
        _, index = self._state.queue(queue)
        cursor = self._state.cursors.get((namespace, group), {}).get(key)
        if cursor is None:
            return index.end - index.earliest
        done = max(cursor.done_below, index.earliest)
        return max(0, index.end - done - sum(1 for o in cursor.acked if o >= done))

    async def consumed_below(self, namespace: str, group: str, queue: QueueRef) -> int:
        self._check_open()
        key = self._queue_key(namespace, queue)
        _, index = self._state.queue(queue)
        cursor = self._state.cursors.get((namespace, group), {}).get(key)
        if cursor is None:
            return index.earliest
        return min(max(cursor.done_below, index.earliest), index.end)

    async def delayed_count(self, namespace: str, queue: QueueRef) -> int:
        self._check_open()
        return self._state.delayed.get(self._queue_key(namespace, queue), 0)

    # ------------------------------------------------------------------ transactions

    def _half(self, held: Held) -> HalfMessage:
        message = rec.decode_entry(held.record.entry)
        assert isinstance(message, Message)
        queues = []
        for d in held.record.dispatches:
            topic = self._state.topics_by_id.get(d.topic_id)
            if topic is not None:
                queues.append(QueueRef(topic.namespace, topic.name, d.queue_id))
        producer_group = held.record.aux.partition("\x00")[2] or None
        return HalfMessage(
            transaction_id=held.record.message_id,
            message_id=held.record.message_id,
            message=message,
            queues=tuple(queues),
            store_timestamp_ms=held.record.store_ms,
            producer_group=producer_group,
        )

    async def append_half(
        self, request: AppendRequest, *, producer_group: str | None = None
    ) -> HalfMessage:
        if not isinstance(request.entry, Message):
            raise InvalidArgument("a transactional half message must be a single Message")
        await self._writable()
        targets = self._validate_append(request)
        namespace = request.queues[0].namespace
        aux = f"{namespace}\x00{producer_group or ''}"
        _, position = self._append_now(request.entry, targets, flags=rec.MESSAGE_HALF, aux=aux)
        await self._log.wait_durable()
        return self._half(self._state.held[position])

    async def end_transaction(
        self, namespace: str, transaction_id: str, *, commit: bool
    ) -> AppendResult | None:
        await self._writable()
        position = self._state.held_by_id.get((namespace, transaction_id))
        held = self._state.held.get(position) if position is not None else None
        if held is None or not held.is_half:
            raise TransactionNotFound(
                f"no undecided transaction {transaction_id!r} in namespace {namespace!r}"
            )
        if commit:
            record = self._make_visible(held)
            await self._log.wait_durable()
            refs = [self._state.ref((d.topic_id, d.queue_id)) for d in record.dispatches]
            return self._result(record, refs)
        self._state.drop_held(held.position)
        self._record(rec.Resolve(held.position, rec.RESOLVE_ROLLBACK))
        await self._log.wait_durable()
        return None

    async def list_undecided(
        self, namespace: str | None = None, *, older_than_ms: int = 0
    ) -> list[HalfMessage]:
        self._check_open()
        cutoff = self._now() - older_than_ms
        return [
            self._half(h)
            for h in self._state.held.values()
            if h.is_half
            and (namespace is None or h.namespace == namespace)
            and h.record.store_ms <= cutoff
        ]

    # ------------------------------------------------------------------ keyed latest value

    async def put_latest(
        self, namespace: str, topic: str, key: bytes, message: Message | None
    ) -> None:
        check_name("topic", topic)
        if message is not None and len(message.body) > self.config.max_message_bytes:
            raise MessageTooLarge(
                f"message of {len(message.body)} bytes is over the limit of "
                f"{self.config.max_message_bytes} bytes"
            )
        await self._writable()
        self._state.namespace(namespace)
        record = rec.Latest(
            namespace, topic, bytes(key), None if message is None else rec.encode_message(message)
        )
        self._state.apply_latest(record)
        self._record(record)
        await self._log.wait_durable()

    async def get_latest(self, namespace: str, topic: str, key: bytes) -> Message | None:
        self._check_open()
        value = self._state.latest.get((namespace, topic), {}).get(bytes(key))
        return None if value is None else rec.decode_message(value)

    async def list_latest(self, namespace: str, topic: str) -> list[tuple[bytes, Message]]:
        self._check_open()
        values = self._state.latest.get((namespace, topic), {})
        return [(key, rec.decode_message(value)) for key, value in sorted(values.items())]

    # ------------------------------------------------------------------ metadata

    async def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        if _nesting_depth(value) > _MAX_META_DEPTH:
            raise InvalidArgument(f"metadata value is nested deeper than {_MAX_META_DEPTH} levels")
        try:
            value = json.loads(json.dumps(value))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"metadata value is not JSON-compatible: {exc}") from exc
        await self._writable()
        self._state.namespace(namespace)
        end = self._meta(op="kv_put", ns=namespace, kind=kind, name=name, value=value)
        await self._log.wait_durable(end)

    async def meta_get(self, namespace: str, kind: str, name: str) -> Any | None:
        self._check_open()
        return self._state.kv.get((namespace, kind), {}).get(name)

    async def meta_delete(self, namespace: str, kind: str, name: str) -> bool:
        await self._writable()
        if name not in self._state.kv.get((namespace, kind), {}):
            return False
        await self._log.wait_durable(self._meta(op="kv_delete", ns=namespace, kind=kind, name=name))
        return True

    async def meta_list(self, namespace: str, kind: str) -> dict[str, Any]:
        self._check_open()
        return dict(self._state.kv.get((namespace, kind), {}))

    # ------------------------------------------------------------------ maintenance

    async def _maintenance_loop(self) -> None:
        interval = 1.0
        since_retention = 0.0
        since_checkpoint = 0.0
        while True:
            await asyncio.sleep(interval)
            since_retention += interval
            since_checkpoint += interval
            try:
                grown = self._log.end - self._checkpoint_position
                if grown > 0 and (
                    since_checkpoint * 1000 >= self.config.checkpoint_interval_ms
                    or grown >= self.config.checkpoint_log_bytes
                ):
                    since_checkpoint = 0.0
                    await self.checkpoint()
                if since_retention * 1000 >= self.config.retention_check_interval_ms:
                    since_retention = 0.0
                    await self.enforce_retention()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("storage maintenance failed; will retry")

    async def checkpoint(self) -> int:
        """Persist indexes and state at the current log end; returns that position."""
        self._check_open()
        async with self._maintenance_lock:
            # The slow parts, built before writers are held; under the gate only what
            # changed in between is rebuilt.
            self._state.topics_snapshot()
            self._state.cursor_snapshot_lines()
            self._gate.clear()
            try:
                await self._log.wait_durable()
                if self.config.durability is Durability.ASYNC:
                    await self._log.fsync()
                position = self._log.end
                state = self._state.snapshot_state(position)
                topics_version = self._state.topics_version
                topics = None
                if self._state.topics_file != (topics_version, state["topics_file"]):
                    topics = self._state.topics_snapshot()
                cursor_lines = self._state.cursor_snapshot_lines()
                dirty, self._state.dirty_queues = self._state.dirty_queues, set()
                writes = self._index_writes(dirty)
                dead = set(self._state.dead_topic_ids)
            finally:
                self._gate.set()
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(
                    None, self._write_checkpoint, writes, state, dead, topics, cursor_lines
                )
            except BaseException:
                self._state.dirty_queues |= dirty  # the next checkpoint writes them again
                raise
            for queue, end, base in ((w[0], w[3], w[4]) for w in writes):
                queue.persisted_end = max(queue.persisted_end, end)
                queue.file_base = base if queue.file_base is None else queue.file_base
            self._state.dead_topic_ids -= dead
            self._state.topics_file = (topics_version, state["topics_file"])
            self._checkpoint_position = position
            return position

    def _index_writes(
        self, dirty: set[QueueKey]
    ) -> list[tuple[QueueIndex, Path, bytes, int, int, bool]]:
        """(queue, path, data, new persisted end, file base, append) for the queues
        that got entries (or need their file rewritten) since the last checkpoint."""
        writes = []
        for tid, qid in dirty:
            topic = self._state.topics_by_id.get(tid)
            if topic is None:
                continue  # deleted since
            queue = topic.queues[qid]
            if queue.end == queue.persisted_end and queue.file_base is not None:
                continue
            if queue.end == queue.base and queue.file_base is None:
                continue
            path = self._index_dir / f"{topic.id}-{qid}.idx"
            can_append = (
                queue.file_base is not None
                and queue.persisted_end >= queue.base
                and queue.base - queue.file_base < (1 << 20)
            )
            if can_append:
                begin = (queue.persisted_end - queue.base) * ENTRY_SIZE
                data = bytes(queue.entries[begin:])
                writes.append((queue, path, data, queue.end, queue.file_base or 0, True))
            else:
                queue.file_base = None
                writes.append((queue, path, bytes(queue.entries), queue.end, queue.base, False))
        return writes

    def _write_checkpoint(
        self,
        writes: list[tuple[QueueIndex, Path, bytes, int, int, bool]],
        state: dict[str, Any],
        dead_topic_ids: set[int],
        topics: list[Any] | None,
        cursor_lines: list[str],
    ) -> None:
        """Runs in a worker thread: everything the snapshot relies on first."""
        for _, path, data, _, base, append in writes:
            write_index_file(path, base, data, append=append)
        if writes:  # new and renamed index files must be on disk before the snapshot
            fsync_directory(self._index_dir)
        if topics is not None:
            write_json_lines(self._dir, state["topics_file"], topics)
        write_lines(self._dir, state["cursors_file"], cursor_lines)
        write_snapshot(self._dir, state)
        remove_stale(self._dir, "topics-*.jsonl", keep=state["topics_file"])
        remove_stale(self._dir, "cursors-*.jsonl", keep=state["cursors_file"])
        for tid in dead_topic_ids:
            for path in self._index_dir.glob(f"{tid}-*.idx"):
                path.unlink(missing_ok=True)

    async def enforce_retention(self) -> None:
        """Delete whole segments past the retention time or size, never one that
        recovery or a held (delayed, half) message still needs; then move queue starts
        and apply per-topic retention."""
        self._check_open()
        async with self._maintenance_lock:
            now_s = self._now() / 1000
            limit = min([self._checkpoint_position, *self._state.held, *self._kept_positions()])
            stats = self._log.segment_stats()
            total = sum(size for _, size, _ in stats)
            delete_below = 0
            for base, size, mtime in stats[:-1]:
                if base + size > limit:
                    break
                too_old = mtime < now_s - self.config.retention_ms / 1000
                too_big = (
                    self.config.retention_bytes is not None and total > self.config.retention_bytes
                )
                if not (too_old or too_big):
                    break
                delete_below = base + size
                total -= size
            if delete_below:
                start = self._log.delete_segments_below(delete_below)
                self._decoded.clear()
                for topic in self._state.topics.values():
                    for queue in topic.queues:
                        queue.trim_to(queue.first_offset_where("position", start))
            self._apply_topic_retention()

    def _kept_positions(self) -> Iterator[int]:
        """The first log position each queue of an unlimited-retention topic still needs."""
        for topic in self._state.topics.values():
            if topic.keeps_everything():
                for queue in topic.queues:
                    if queue.earliest < queue.end:
                        yield queue.position(queue.earliest)

    def _apply_topic_retention(self) -> None:
        now = self._now()
        for topic in self._state.topics.values():
            retention_ms, retention_bytes = topic.config.retention_ms, topic.config.retention_bytes
            for queue in topic.queues:
                if retention_ms is not None and retention_ms != UNLIMITED:
                    first = queue.first_offset_where("store_ms", now - retention_ms)
                    queue.earliest = max(queue.earliest, first)
                if retention_bytes is not None and retention_bytes != UNLIMITED:
                    queue.earliest = max(
                        queue.earliest, _first_within_bytes(queue, retention_bytes)
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


def _ranges(offsets: Sequence[int]) -> list[list[int]]:
    """Sorted offsets as ``[first, end)`` runs (compact on disk, in the closing record)."""
    runs: list[list[int]] = []
    for offset in offsets:
        if runs and runs[-1][1] == offset:
            runs[-1][1] = offset + 1
        else:
            runs.append([offset, offset + 1])
    return runs


def _nesting_depth(value: Any, depth: int = 0) -> int:
    """How deep lists and dicts nest in ``value`` (stops counting past the bound)."""
    if depth > _MAX_META_DEPTH or not isinstance(value, list | dict):
        return depth
    children = value.values() if isinstance(value, dict) else value
    return max((_nesting_depth(child, depth + 1) for child in children), default=depth + 1)


def _first_within_bytes(queue: QueueIndex, limit: int) -> int:
    """The first offset such that the records from there to the end fit in ``limit``."""
    total = 0
    offset = queue.end
    last_position = -1
    while offset > queue.earliest:
        entry = queue.get(offset - 1)
        if entry.position != last_position:  # a batch's offsets share one record
            total += entry.size
            last_position = entry.position
        if total > limit:
            return offset
        offset -= 1
    return offset
