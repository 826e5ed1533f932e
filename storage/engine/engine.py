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

:class:`Engine` is the façade: it owns the shared state (:class:`EngineCore`), starts
and stops the engine, and hands each call to the part whose job it is (topics.py,
compaction.py, appends.py, transactions.py, reads.py, offsets.py, pops.py, keyed.py,
maintenance.py), so each part can be read without the others.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from polymq.storage.api import (
    DEFAULT_INVISIBLE_MS,
    DEFAULT_POP_MAX_MESSAGES,
    DEFAULT_READ_MAX_BYTES,
    DEFAULT_READ_MAX_MESSAGES,
    DEFAULT_TOPIC_CONFIG,
    DEFAULT_WAIT_MS,
)
from polymq.storage.clock import Clock, SystemClock
from polymq.storage.engine.appends import Appends
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.engine.compaction import Compaction
from polymq.storage.engine.config import EngineConfig
from polymq.storage.engine.core import EngineCore
from polymq.storage.engine.keyed import LatestValues, Metadata
from polymq.storage.engine.maintenance import Maintenance, apply_topic_retention
from polymq.storage.engine.offsets import Offsets
from polymq.storage.engine.pops import Pops
from polymq.storage.engine.reads import Reads
from polymq.storage.engine.recovery import recover
from polymq.storage.engine.stats import LogStats
from polymq.storage.engine.topics import Topics
from polymq.storage.engine.transactions import Transactions
from polymq.storage.lifecycle import Service
from polymq.storage.model import (
    DEFAULT_NAMESPACE,
    AppendRequest,
    AppendResult,
    BatchEntry,
    CommittedOffset,
    GroupConfig,
    HalfMessage,
    Message,
    QueueOffsets,
    QueueRef,
    ReadResult,
    StoredBatch,
    StoredMessage,
    TopicConfig,
    TopicInfo,
)

__all__ = ["Engine"]

log = logging.getLogger(__name__)


class Engine(Service):
    """The embedded engine. Use as ``async with Engine(config) as engine:``."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: Clock | None = None,
        log: Callable[[Path], CommitLog] | None = None,
    ) -> None:
        """``log``: makes the commit log for its directory (default: local segment
        files; ``storage.replicated`` passes a log kept in JetStream)."""
        super().__init__()
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self._core = core = EngineCore(config, self.clock, self.tasks, log)
        # The same objects as the core's, under the names tests look at.
        self._log = core.log
        self._state = core.state
        self._gate = core.gate
        self._topics = Topics(core)
        self._compaction = Compaction(core)
        self._appends = Appends(core)
        self._transactions = Transactions(core, self._appends)
        self._reads = Reads(core)
        self._offsets = Offsets(core)
        self._pops = Pops(core, self._reads, self._appends)
        self._latest = LatestValues(core)
        self._metadata = Metadata(core)
        self._maintenance = Maintenance(core, self._reads.forget_decoded)

    @property
    def log_stats(self) -> LogStats:
        """Its commit log's fsync and group-commit figures, for /metrics."""
        return self._log.stats

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        core = self._core
        if core.started:
            return
        await self._log.prepare()
        replayed = recover(core)
        await self._log.seal()
        log.info(
            "storage: opened %s at log position %d (%d records replayed)",
            core.dir,
            self._log.end,
            replayed,
        )
        self._log.start_flushing()
        core.started = True
        if DEFAULT_NAMESPACE not in self._state.namespaces:
            await self.create_namespace(DEFAULT_NAMESPACE)
        apply_topic_retention(core)
        self.tasks.spawn(self._appends.deliver_due_loop(), name="polymq-delayed-delivery")
        self.tasks.spawn(self._maintenance.loop(), name="polymq-maintenance")

    async def close(self) -> None:
        core = self._core
        if core.closed or not core.started:
            core.closed = True
            await super().close()
            return
        # The chores stop first: the last checkpoint is this one, not theirs.
        await super().close()
        with contextlib.suppress(Exception):
            await self.checkpoint()
        core.closed = True
        for topic in self._state.topics.values():
            for queue in topic.queues:
                queue.wake()
        await self._log.close()

    # ------------------------------------------------------------------ namespaces

    async def create_namespace(self, namespace: str) -> None:
        await self._topics.create_namespace(namespace)

    async def delete_namespace(self, namespace: str) -> None:
        await self._topics.delete_namespace(namespace)

    async def list_namespaces(self) -> list[str]:
        return self._topics.list_namespaces()

    # ------------------------------------------------------------------ topics

    async def create_topic(
        self, namespace: str, topic: str, config: TopicConfig = DEFAULT_TOPIC_CONFIG
    ) -> TopicInfo:
        return await self._topics.create_topic(namespace, topic, config)

    async def alter_topic(self, namespace: str, topic: str, config: TopicConfig) -> TopicInfo:
        return await self._topics.alter_topic(namespace, topic, config)

    async def delete_topic(self, namespace: str, topic: str) -> None:
        await self._topics.delete_topic(namespace, topic)

    async def list_topics(
        self, namespace: str, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        return self._topics.list_topics(namespace, include_internal)

    async def describe_topic(self, namespace: str, topic: str) -> TopicInfo:
        return self._topics.describe_topic(namespace, topic)

    async def queue_offsets(self, queue: QueueRef) -> QueueOffsets:
        return self._topics.queue_offsets(queue)

    async def delete_records(self, queue: QueueRef, before_offset: int) -> QueueOffsets:
        return await self._topics.delete_records(queue, before_offset)

    async def compact(
        self,
        queue: QueueRef,
        drop: Sequence[int] = (),
        rewrite: Mapping[int, BatchEntry] | None = None,
    ) -> int:
        """See :meth:`storage.api.StorageAPI.compact` and compaction.py."""
        return await self._compaction.compact(queue, drop, rewrite)

    async def offset_for_timestamp(self, queue: QueueRef, timestamp_ms: int) -> int:
        return self._topics.offset_for_timestamp(queue, timestamp_ms)

    # ------------------------------------------------------------------ append

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        return await self._appends.append(requests)

    async def append_visible(
        self, requests: Sequence[AppendRequest]
    ) -> tuple[list[AppendResult], Callable[[], Awaitable[None]] | None]:
        """:meth:`append` answered once readable, with the wait for its fsync (not
        part of :class:`StorageAPI`: the processor falls back to :meth:`append`)."""
        return await self._appends.append_visible(requests)

    async def cancel_delayed(self, namespace: str, message_id: str) -> bool:
        return await self._appends.cancel_delayed(namespace, message_id)

    # ------------------------------------------------------------------ reading

    async def read(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = DEFAULT_READ_MAX_MESSAGES,
        max_bytes: int = DEFAULT_READ_MAX_BYTES,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> ReadResult:
        return await self._reads.read(queue, offset, max_messages, max_bytes, wait_ms)

    async def read_batches(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_bytes: int = DEFAULT_READ_MAX_BYTES,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> list[StoredBatch]:
        return await self._reads.read_batches(queue, offset, max_bytes, wait_ms)

    # ------------------------------------------------------------------ offsets (stream mode)

    async def commit_offset(
        self, namespace: str, group: str, queue: QueueRef, offset: int, metadata: str = ""
    ) -> None:
        await self._offsets.commit_offset(namespace, group, queue, offset, metadata)

    async def fetch_offset(
        self, namespace: str, group: str, queue: QueueRef
    ) -> CommittedOffset | None:
        return self._offsets.fetch_offset(namespace, group, queue)

    async def list_group_offsets(
        self, namespace: str, group: str
    ) -> dict[QueueRef, CommittedOffset]:
        return self._offsets.list_group_offsets(namespace, group)

    async def delete_group_offsets(
        self, namespace: str, group: str, queues: Sequence[QueueRef] | None = None
    ) -> None:
        await self._offsets.delete_group_offsets(namespace, group, queues)

    async def list_groups(self, namespace: str) -> list[str]:
        return self._offsets.list_groups(namespace)

    # ------------------------------------------------------------------ pop mode

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None:
        await self._pops.set_group_config(namespace, group, config)

    async def get_group_config(self, namespace: str, group: str) -> GroupConfig:
        return self._pops.get_group_config(namespace, group)

    async def pop(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int = DEFAULT_POP_MAX_MESSAGES,
        invisible_ms: int = DEFAULT_INVISIBLE_MS,
        wait_ms: int = DEFAULT_WAIT_MS,
        tags: frozenset[str] | None = None,
        durable: bool = True,
    ) -> list[StoredMessage]:
        return await self._pops.pop(
            namespace, group, queues, max_messages, invisible_ms, wait_ms, tags, durable
        )

    async def ack(self, namespace: str, group: str, receipt: str, *, durable: bool = True) -> None:
        await self._pops.ack(namespace, group, receipt, durable=durable)

    async def ack_many(
        self, namespace: str, group: str, receipts: Sequence[str], *, durable: bool = True
    ) -> list[str | None]:
        return await self._pops.ack_many(namespace, group, receipts, durable=durable)

    async def change_invisibility(
        self, namespace: str, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        return await self._pops.change_invisibility(namespace, group, receipt, invisible_ms)

    async def nack(self, namespace: str, group: str, receipt: str, *, delay_ms: int = 0) -> None:
        await self._pops.change_invisibility(namespace, group, receipt, delay_ms)

    async def give_back(self, namespace: str, group: str, receipts: Sequence[str]) -> None:
        await self._pops.give_back(namespace, group, receipts)

    async def dead_letter(self, namespace: str, group: str, receipt: str) -> None:
        await self._pops.dead_letter(namespace, group, receipt)

    async def inflight_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return self._pops.inflight_count(namespace, group, queue)

    async def pending_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return self._pops.pending_count(namespace, group, queue)

    async def consumed_below(self, namespace: str, group: str, queue: QueueRef) -> int:
        return self._pops.consumed_below(namespace, group, queue)

    async def delayed_count(self, namespace: str, queue: QueueRef) -> int:
        return self._appends.delayed_count(namespace, queue)

    # ------------------------------------------------------------------ transactions

    async def append_half(
        self, request: AppendRequest, *, producer_group: str | None = None
    ) -> HalfMessage:
        return await self._transactions.append_half(request, producer_group)

    async def end_transaction(
        self, namespace: str, transaction_id: str, *, commit: bool
    ) -> AppendResult | None:
        return await self._transactions.end_transaction(namespace, transaction_id, commit)

    async def list_undecided(
        self, namespace: str | None = None, *, older_than_ms: int = 0
    ) -> list[HalfMessage]:
        return self._transactions.list_undecided(namespace, older_than_ms)

    # ------------------------------------------------------------------ keyed latest value

    async def put_latest(
        self, namespace: str, topic: str, key: bytes, message: Message | None
    ) -> None:
        await self._latest.put_latest(namespace, topic, key, message)

    async def get_latest(self, namespace: str, topic: str, key: bytes) -> Message | None:
        return self._latest.get_latest(namespace, topic, key)

    async def list_latest(self, namespace: str, topic: str) -> list[tuple[bytes, Message]]:
        return self._latest.list_latest(namespace, topic)

    # ------------------------------------------------------------------ metadata

    async def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        await self._metadata.meta_put(namespace, kind, name, value)

    async def meta_get(self, namespace: str, kind: str, name: str) -> Any | None:
        return self._metadata.meta_get(namespace, kind, name)

    async def meta_delete(self, namespace: str, kind: str, name: str) -> bool:
        return await self._metadata.meta_delete(namespace, kind, name)

    async def meta_list(self, namespace: str, kind: str) -> dict[str, Any]:
        return self._metadata.meta_list(namespace, kind)

    # ------------------------------------------------------------------ maintenance

    async def checkpoint(self) -> int:
        """Persist indexes and state at the current log end; returns that position."""
        return await self._maintenance.checkpoint()

    async def enforce_retention(self) -> None:
        """See :meth:`Maintenance.enforce_retention`."""
        await self._maintenance.enforce_retention()
