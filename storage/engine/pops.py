"""Pop mode (RocketMQ's and MNS's queues, AMQP's consumers): messages handed out to a
group, invisible until acked or their invisibility runs out, then handed out again,
dead-lettered after too many attempts.

Every hand-out and ack is one log record, applied by the same function a replay uses,
so a restart hands out again exactly what was not acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from polymq.storage.api import check_invisible_ms, check_pop
from polymq.storage.engine import records as rec
from polymq.storage.engine.appends import Appends
from polymq.storage.engine.core import EngineCore, EnginePart
from polymq.storage.engine.ids import decode_receipt, encode_receipt
from polymq.storage.engine.pop_state import Inflight, PopCursor
from polymq.storage.engine.queue_index import IndexEntry, QueueIndex
from polymq.storage.engine.reads import Reads, stored_message
from polymq.storage.engine.state import Topic, config_to_json, text_hash
from polymq.storage.errors import InvalidArgument, InvalidReceipt, StorageError
from polymq.storage.model import GroupConfig, Message, QueueRef, StoredMessage, TopicConfig
from polymq.storage.names import check_name

__all__ = ["Pops"]

log = logging.getLogger(__name__)

_FIFO_SCAN_LIMIT = 4096  # offsets a FIFO pop looks ahead past blocked message groups
_READ_AHEAD_BYTES = 1 << 20  # records a pop reads from the log in one go, at most (about)
_DLQ_PREFIX = "%DLQ%"
# What undoes one hand-out of a pop: topic, queue id, offset, its seq, the state before.
_HandOut = tuple[Topic, int, int, int, Inflight | None]
_Target = tuple[QueueRef, Topic, QueueIndex]


class Pops(EnginePart):
    """The pop-mode groups of one engine."""

    def __init__(self, core: EngineCore, reads: Reads, appends: Appends) -> None:
        super().__init__(core)
        self._reads = reads
        self._appends = appends
        self._rotation = 0

    # ------------------------------------------------------------------ applying records

    def _ack_now(
        self, group: str, topic_id: int, queue_id: int, offset: int, *, durable: bool = True
    ) -> None:
        """Log and apply an ack, through the same function a replay uses."""
        record = rec.Ack(group, topic_id, queue_id, offset)
        self._state.apply_ack(record)
        self._core.record(record, durable=durable)

    def _hand_out_now(
        self,
        group: str,
        topic_id: int,
        queue_id: int,
        offset: int,
        state: Inflight,
        *,
        durable: bool = True,
    ) -> None:
        """Log and apply a hand-out (a pop or a new invisibility), as a replay would.
        ``durable=False`` (a pop that does not wait for its fsync) asks for no fsync of
        its own: the next group commit that needs one covers it."""
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
        self._core.record(record, durable=durable)

    # ------------------------------------------------------------------ group configs

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None:
        check_name("group", group)
        if config.max_delivery_attempts is not None and config.max_delivery_attempts < 1:
            raise InvalidArgument("max_delivery_attempts must be at least 1")
        if config.dead_letter_topic is not None:
            check_name("topic", config.dead_letter_topic)
        await self._core.writable()
        self._state.namespace(namespace)
        end = self._core.meta(
            op="group_config", ns=namespace, group=group, config=config_to_json(config)
        )
        await self._log.wait_durable(end)

    def get_group_config(self, namespace: str, group: str) -> GroupConfig:
        self._core.check_open()
        return self._state.group_configs.get((namespace, group), GroupConfig())

    def _is_fifo(self, namespace: str, group: str) -> bool:
        """In a FIFO group an ack releases the next message of its message group, so
        pops waiting on the queue must look again; otherwise an ack frees nothing."""
        return self._state.group_configs.get((namespace, group), GroupConfig()).fifo

    # ------------------------------------------------------------------ handing out

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
        max_messages: int,
        invisible_ms: int,
        wait_ms: int,
        tags: frozenset[str] | None,
        durable: bool,
    ) -> list[StoredMessage]:
        check_pop(group, queues, max_messages, invisible_ms)
        core = self._core
        deadline = core.now() + max(0, wait_ms)
        while True:
            await core.writable()
            targets = [(ref, *self._state.queue(ref)) for ref in queues]
            for ref, _, _ in targets:
                core.queue_key(namespace, ref)
            handed: list[_HandOut] = []
            popped, end = self._pop_now(
                namespace, group, targets, max_messages, invisible_ms, tags, handed, durable
            )
            if popped or core.now() >= deadline:
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
            await self._reads.wait_for_data([q for _, _, q in targets], deadline, wake_at)

    def _give_back(self, namespace: str, group: str, handed: list[_HandOut]) -> None:
        """A pop cancelled after it handed messages out (while it waited for their
        hand-out records): nobody got them, so they are visible again at once, with
        their attempt as before, instead of staying invisible for ``invisible_ms``."""
        core = self._core
        if not handed or core.closed or core.tasks.closed:
            return
        if not core.gate.is_set():
            # A checkpoint holds writers (or storage closes): no record may be reserved
            # now. Give back as soon as the gate opens, unless storage is gone.
            async def later() -> None:
                with contextlib.suppress(StorageError):
                    await core.writable()
                    self._give_back(namespace, group, handed)

            core.tasks.spawn(later(), name="polymq-give-back")
            return
        now = core.now()
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

    def _next_redelivery(self, namespace: str, group: str, targets: list[_Target]) -> int | None:
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
        targets: list[_Target],
        max_messages: int,
        invisible_ms: int,
        tags: frozenset[str] | None,
        handed: list[_HandOut],
        durable: bool = True,
    ) -> tuple[list[StoredMessage], int | None]:
        """Hand out what is visible; ``handed`` gets what :meth:`_give_back` needs to
        undo each hand-out."""
        config = self._state.group_configs.get((namespace, group), GroupConfig())
        tag_hashes = None if tags is None or "*" in tags else {text_hash(t) for t in tags}
        now = self._core.now()
        popped: list[StoredMessage] = []
        logged = False
        self._rotation += 1
        start = self._rotation % len(targets)
        for ref, topic, queue in targets[start:] + targets[:start]:
            if len(popped) >= max_messages:
                break
            cursor = self._state.cursor((namespace, group), topic.id, ref.queue_id)
            candidates = self._pop_candidates(cursor, queue, config.fifo, now)
            # FIFO's candidates depend on what was handed out before: one at a time.
            wanted = (lambda: 1) if config.fifo else (lambda: max_messages - len(popped))
            for offset, entry, found in self._read_ahead(candidates, queue, wanted):
                if found is None:  # a gap left by compaction: nothing to hand out
                    self._ack_now(group, topic.id, ref.queue_id, offset)
                    logged = True
                    continue
                message, message_id = found
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
                self._hand_out_now(group, topic.id, ref.queue_id, offset, state, durable=durable)
                handed.append((topic, ref.queue_id, offset, state.seq, previous))
                popped.append(
                    stored_message(
                        message,
                        message_id,
                        ref,
                        offset,
                        entry,
                        delivery_attempt=attempt,
                        receipt=encode_receipt(topic.id, ref.queue_id, offset, state.seq),
                        first_pop_ms=first_pop,
                        next_visible_ms=state.deadline_ms,
                    )
                )
                if len(popped) >= max_messages:
                    break
        return popped, (self._log.end if logged else None)

    def _read_ahead(
        self, offsets: Iterator[int], queue: QueueIndex, wanted: Callable[[], int]
    ) -> Iterator[tuple[int, IndexEntry, tuple[Message, str] | None]]:
        """Each offset with its index entry and message (``None`` for a gap), read up
        to ``wanted()`` offsets (and about _READ_AHEAD_BYTES) at a time: neighbours in
        the log then cost one read, not one each. Lazy: the next offsets are taken only
        once the last were used, so ``wanted() == 1`` keeps ``offsets`` in step."""
        while True:
            chunk: list[tuple[int, IndexEntry]] = []
            limit, budget = wanted(), _READ_AHEAD_BYTES
            for offset in offsets:
                entry = queue.get(offset)
                chunk.append((offset, entry))
                budget -= entry.size
                if len(chunk) >= limit or budget <= 0:
                    break
            if not chunk:
                return
            stored = [entry for _, entry in chunk if entry.size]
            loaded = iter(self._reads.messages_at(stored) if stored else ())
            for offset, entry in chunk:
                yield offset, entry, next(loaded) if entry.size else None

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
            topic = self._core.create_topic_now(namespace, name, TopicConfig())
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
        self._appends.append_now(dead, [(topic, 0)], message_id=message_id)
        log.info("moved %s offset %d to %s after %d deliveries", origin, offset, name, attempts)

    # ------------------------------------------------------------------ receipts

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

    async def ack(self, namespace: str, group: str, receipt: str, *, durable: bool = True) -> None:
        await self._core.writable()
        topic, qid, offset, _, _ = self._inflight_for(namespace, group, receipt)
        self._ack_now(group, topic.id, qid, offset, durable=durable)
        if self._is_fifo(namespace, group):
            topic.queues[qid].wake()
        await self._settled(durable)

    async def _settled(self, durable: bool) -> None:
        """Wait for the acks just logged: fsynced, or (``durable=False``) written."""
        if durable:
            await self._log.wait_durable()
        else:
            await self._log.wait_written()

    async def ack_many(
        self, namespace: str, group: str, receipts: Sequence[str], *, durable: bool = True
    ) -> list[str | None]:
        await self._core.writable()
        outcomes: list[str | None] = []
        acked: set[QueueIndex] = set()
        for receipt in receipts:
            try:
                topic, qid, offset, _, _ = self._inflight_for(namespace, group, receipt)
            except InvalidReceipt as exc:
                outcomes.append(exc.code)
                continue
            self._ack_now(group, topic.id, qid, offset, durable=durable)
            acked.add(topic.queues[qid])
            outcomes.append(None)
        if self._is_fifo(namespace, group):
            for queue in acked:
                queue.wake()
        await self._settled(durable)
        return outcomes

    async def change_invisibility(
        self, namespace: str, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        check_invisible_ms(invisible_ms)
        await self._core.writable()
        topic, qid, offset, _, state = self._inflight_for(namespace, group, receipt)
        new = Inflight(
            self._core.now() + invisible_ms,
            state.attempt,
            self._state.pop_seq + 1,
            state.first_pop_ms,
        )
        self._hand_out_now(group, topic.id, qid, offset, new)
        # A pop waiting on this queue computed its wake-up from the old deadline.
        topic.queues[qid].wake()
        await self._log.wait_durable()
        ref = QueueRef(topic.namespace, topic.name, qid)
        return self._reads.stored(
            ref,
            topic.queues[qid],
            offset,
            delivery_attempt=new.attempt,
            receipt=encode_receipt(topic.id, qid, offset, new.seq),
            first_pop_ms=new.first_pop_ms,
            next_visible_ms=new.deadline_ms,
        )

    async def give_back(self, namespace: str, group: str, receipts: Sequence[str]) -> None:
        """See :meth:`storage.api.StorageAPI.give_back`: what :meth:`_give_back` does for
        a pop cancelled here, for a pop whose caller stopped waiting elsewhere. The
        hand-outs are written, not fsynced: one lost to a power cut stays invisible
        until its lease runs out, as it would have without this."""
        await self._core.writable()
        now = self._core.now()
        woken: set[QueueIndex] = set()
        for receipt in receipts:
            try:
                topic, qid, offset, _, state = self._inflight_for(namespace, group, receipt)
            except InvalidReceipt:
                continue  # acked, or handed out again, since
            # The pop that handed it out counted one attempt more than it had.
            attempt = max(0, state.attempt - 1)
            restored = Inflight(now, attempt, self._state.pop_seq + 1, state.first_pop_ms)
            self._hand_out_now(group, topic.id, qid, offset, restored, durable=False)
            woken.add(topic.queues[qid])
        for queue in woken:
            queue.wake()
        await self._log.wait_written()

    async def dead_letter(self, namespace: str, group: str, receipt: str) -> None:
        await self._core.writable()
        topic, qid, offset, _, state = self._inflight_for(namespace, group, receipt)
        ref = QueueRef(topic.namespace, topic.name, qid)
        [(message, message_id)] = self._reads.messages_at([topic.queues[qid].get(offset)])
        config = self._state.group_configs.get((namespace, group), GroupConfig())
        self._dead_letter(namespace, group, config, ref, offset, message, message_id, state.attempt)
        self._ack_now(group, topic.id, qid, offset)
        if self._is_fifo(namespace, group):
            topic.queues[qid].wake()
        await self._log.wait_durable()

    # ------------------------------------------------------------------ counts

    def _cursor_at(
        self, namespace: str, group: str, queue: QueueRef
    ) -> tuple[PopCursor | None, QueueIndex]:
        """The group's cursor on a queue (None before its first pop), and the queue."""
        self._core.check_open()
        key = self._core.queue_key(namespace, queue)
        _, index = self._state.queue(queue)
        return self._state.cursors.get((namespace, group), {}).get(key), index

    def inflight_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        cursor, _ = self._cursor_at(namespace, group, queue)
        return len(cursor.inflight) if cursor else 0

    def pending_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        cursor, index = self._cursor_at(namespace, group, queue)
        if cursor is None:
            return index.end - index.earliest
        done = max(cursor.done_below, index.earliest)
        return max(0, index.end - done - sum(1 for o in cursor.acked if o >= done))

    def consumed_below(self, namespace: str, group: str, queue: QueueRef) -> int:
        cursor, index = self._cursor_at(namespace, group, queue)
        if cursor is None:
            return index.earliest
        return min(max(cursor.done_below, index.earliest), index.end)
