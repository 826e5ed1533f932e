"""Appending messages, and delivering delayed ones when they fall due.

Every message that enters a queue goes through :meth:`Appends.append_now`: a plain
append, a delayed message made visible, a committed transaction, a dead letter. It
assigns offsets and reserves the record in one synchronous step, so offsets along a
queue follow log positions.
"""

from __future__ import annotations

import asyncio
import heapq
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from polymq.storage import batch_formats
from polymq.storage.api import check_append_queues
from polymq.storage.engine import records as rec
from polymq.storage.engine.commit_log import HEADER_SIZE
from polymq.storage.engine.core import EnginePart
from polymq.storage.engine.reads import DECODED_CACHE
from polymq.storage.engine.state import Held, Seen, Topic, text_hash
from polymq.storage.errors import InvalidArgument, MessageTooLarge
from polymq.storage.model import (
    AppendRequest,
    AppendResult,
    BatchEntry,
    Message,
    Placement,
    QueueRef,
)
from polymq.storage.names import check_name

__all__ = ["Appends", "append_result"]


class Appends(EnginePart):
    """The write side of one engine."""

    def _max_bytes(self, topic: Topic) -> int:
        limit = self._core.config.max_message_bytes
        if topic.config.max_message_bytes is not None:
            limit = min(limit, topic.config.max_message_bytes)
        return limit

    def validate(self, request: AppendRequest) -> list[tuple[Topic, int]]:
        """The (topic, queue id) targets of a request, once it is known to fit them."""
        if request.dedup_key is not None:
            check_name("dedup key", request.dedup_key)
        if not isinstance(request.entry, Message | BatchEntry):
            raise InvalidArgument("entry must be a Message or a BatchEntry")
        check_append_queues(request)
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
            now = self._core.now()
            if any((m.delivery_time_ms or 0) > now for m in entry.messages):
                raise InvalidArgument("batch entries cannot be delayed; append messages singly")
        limit = min(self._max_bytes(topic) for topic, _ in targets)
        if size > limit:
            raise MessageTooLarge(f"message of {size} bytes is over the limit of {limit} bytes")
        return targets

    def append_now(
        self,
        entry: Message | BatchEntry,
        targets: Sequence[tuple[Topic, int]],
        *,
        encoded: bytes | None = None,
        message_id: str | None = None,
        flags: int = 0,
        source: int = -1,
        aux: str = "",
        durable: bool = True,
    ) -> tuple[rec.MessageRecord, int]:
        """Reserve one message record; offsets are assigned now and become readable when
        it is durable. Synchronous: no other task runs between check and reserve."""
        ids = self._core.ids
        assert ids is not None
        # Encoded before any offset is reserved: a value the record format cannot hold
        # (a timestamp past int64) must fail the append, not leave an index gap.
        if encoded is None:
            try:
                encoded = rec.encode_entry(entry)
            except (struct.error, OverflowError) as e:
                raise InvalidArgument(f"message cannot be stored: {e}") from e
        now = self._core.now()
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
            message_id=message_id or ids.next(now),
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
            payload,
            on_durable=lambda: self._state.publish(position, size, record),
            durable=durable,
        )
        self._state.apply_message(position, size, record)
        if type(entry) is Message and _as_decoded(entry):
            decoded = self._core.decoded
            decoded[position] = (record.message_id, entry)
            if len(decoded) > DECODED_CACHE:
                decoded.popitem(last=False)
        return record, position

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        done, checked = await self._reserve(requests)
        if any(request.durable for request in requests):
            await self._log.wait_durable()
        else:  # what the client asked: written (readable), fsynced within the interval
            await self._log.wait_reported()
        return _results(done, checked)

    async def append_visible(
        self, requests: Sequence[AppendRequest]
    ) -> tuple[list[AppendResult], Callable[[], Awaitable[None]] | None]:
        """:meth:`append`, returning once the entries are readable (written), with
        what to await for the fsync the durable ones asked for (None: nothing): a
        caller that answers in order (a Kafka connection) handles its next request
        while the fsync runs."""
        done, checked = await self._reserve(requests)
        log = self._log
        end = log.end
        await log.wait_reported()
        results = _results(done, checked)
        if not any(request.durable for request in requests):
            return results, None
        return results, lambda: log.wait_durable(end)

    async def _reserve(
        self, requests: Sequence[AppendRequest]
    ) -> tuple[list[rec.MessageRecord | AppendResult], list[tuple[AppendRequest, Any]]]:
        """Check every request, then reserve their records (or find them stored under
        their dedup keys), without awaiting in between."""
        await self._core.writable()
        checked = [(r, self.validate(r)) for r in requests]
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
                    self.append_now(
                        request.entry,
                        targets,
                        aux=request.dedup_key or "",
                        message_id=request.message_id,
                        durable=request.durable,
                    )[0]
                )
        return done, checked

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

    # ------------------------------------------------------------------ delayed delivery

    async def cancel_delayed(self, namespace: str, message_id: str) -> bool:
        await self._core.writable()
        position = self._state.held_by_id.get((namespace, message_id))
        held = self._state.held.get(position) if position is not None else None
        if held is None or held.is_half:
            return False
        self._state.drop_held(held.position)
        self._core.record(rec.Resolve(held.position, rec.RESOLVE_CANCEL))
        await self._log.wait_durable()
        return True

    def delayed_count(self, namespace: str, queue: QueueRef) -> int:
        self._core.check_open()
        return self._state.delayed.get(self._core.queue_key(namespace, queue), 0)

    async def deliver_due_loop(self) -> None:
        state, clock = self._state, self._core.clock
        while True:
            now = self._core.now()
            while state.due and (state.due[0][1] not in state.held):
                heapq.heappop(state.due)
            if state.due and state.due[0][0] <= now:
                await self._core.writable()
                while state.due and state.due[0][0] <= self._core.now():
                    _, position = heapq.heappop(state.due)
                    held = state.held.get(position)
                    if held is not None:
                        self.make_visible(held)
                continue
            state.due_changed.clear()
            waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(state.due_changed.wait())]
            if state.due:
                waiters.append(asyncio.ensure_future(clock.sleep_until(state.due[0][0])))
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    def make_visible(self, held: Held) -> rec.MessageRecord:
        """Append a visible copy of a held message (same id and body) into its queues."""
        targets = []
        for d in held.record.dispatches:
            topic = self._state.topics_by_id.get(d.topic_id)
            if topic is not None and d.queue_id < len(topic.queues):
                targets.append((topic, d.queue_id))
        entry = rec.decode_entry(held.record.entry)
        record, _ = self.append_now(
            entry,
            targets,
            encoded=held.record.entry,
            message_id=held.record.message_id,
            flags=0,
            source=held.position,
        )
        return record


_CACHED_BODY_BYTES = 64 << 10  # larger bodies are read back: the cache stays small


def _as_decoded(message: Message) -> bool:
    """Whether ``message`` is exactly what decoding its record gives back, so a
    hand-out may use it as is: plain ``bytes`` and tuples only (a protocol may pass a
    ``memoryview`` over a buffer it reuses, or a list), and a small body."""
    body, key, correlation = message.body, message.key, message.correlation_id
    return (
        type(body) is bytes
        and len(body) <= _CACHED_BODY_BYTES
        and (key is None or type(key) is bytes)
        and (correlation is None or type(correlation) is bytes)
        and type(message.properties) is tuple
        and all(type(p) is tuple and type(p[1]) is bytes for p in message.properties)
    )


def _results(
    done: list[rec.MessageRecord | AppendResult], checked: list[tuple[AppendRequest, Any]]
) -> list[AppendResult]:
    return [
        item if isinstance(item, AppendResult) else append_result(item, request.queues)
        for item, (request, _) in zip(done, checked, strict=True)
    ]


def append_result(record: rec.MessageRecord, queues: Sequence[QueueRef]) -> AppendResult:
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
