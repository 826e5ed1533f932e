"""What every part of the engine shares: the files, the state, the write gate.

The engine is split by job (topics, appends, reads, pops, maintenance, ...), each part
a plain object that holds this core. The core is the one place that knows whether the
engine is open and whether a checkpoint holds writers, so every part checks the same
way, and no part reaches into another part's state.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polymq.storage.clock import Clock
from polymq.storage.engine import records as rec
from polymq.storage.engine.commit_log import CommitLog
from polymq.storage.engine.config import EngineConfig
from polymq.storage.engine.ids import MessageIds
from polymq.storage.engine.state import EngineState, QueueKey, Topic, config_to_json
from polymq.storage.errors import InvalidArgument, StorageClosed
from polymq.storage.lifecycle import TaskSet
from polymq.storage.model import BatchEntry, Message, QueueRef, TopicConfig

__all__ = ["EngineCore", "EnginePart"]


class EngineCore:
    """The shared state of one engine, and the steps every part takes to change it."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Clock,
        tasks: TaskSet,
        log: Callable[[Path], CommitLog] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.dir = Path(config.data_dir)
        self.index_dir = self.dir / "index"
        log_dir = self.dir / "commitlog"
        self.log = (
            log(log_dir)
            if log is not None
            else CommitLog(
                log_dir,
                segment_bytes=config.segment_bytes,
                durability=config.durability,
                flush_interval_ms=config.flush_interval_ms,
                visible_before_fsync=config.visible_before_fsync,
            )
        )
        self.state = EngineState(dedup_window_ms=config.dedup_window_ms, clock=clock)
        # Entries by log position, as decoded from the log (reads.py keeps expanded
        # batches here) or as just appended (appends.py: a hand-out of a message
        # popped soon after its append needs no read back and no decoding).
        self.decoded: OrderedDict[int, tuple[str, Message | BatchEntry]] = OrderedDict()
        self.ids: MessageIds | None = None  # read from the data directory at start
        self.gate = asyncio.Event()
        self.gate.set()
        self.maintenance_lock = asyncio.Lock()
        self.checkpoint_position = 0
        self.tasks = tasks  # the engine's background work, cancelled at close
        self.started = False
        self.closed = False

    def now(self) -> int:
        return self.clock.now_ms()

    def queue_key(self, namespace: str, ref: QueueRef) -> QueueKey:
        """The ids of a queue that a group of ``namespace`` may use."""
        if ref.namespace != namespace:
            raise InvalidArgument(f"queue {ref} is not in namespace {namespace!r}")
        topic, _ = self.state.queue(ref)
        return topic.id, ref.queue_id

    def check_open(self) -> None:
        if self.closed or not self.started:
            raise StorageClosed("storage is not open")

    async def writable(self) -> None:
        """Wait while a checkpoint holds the gate. Callers read state only after this
        returns and reserve their records without awaiting in between."""
        self.check_open()
        if not self.gate.is_set():
            await self.gate.wait()
            self.check_open()

    # ------------------------------------------------------------------ applying records

    def record(self, record: rec.Record, *, durable: bool = True) -> int:
        """Reserve a non-message record; its in-memory effect is applied by the caller.
        ``durable=False``: nobody waits for its fsync (see ``CommitLog.reserve``)."""
        return self.log.reserve(rec.encode_record(record), durable=durable)

    def meta(self, **op: Any) -> int:
        """Log and apply one metadata change; returns the log end to wait for."""
        self.state.apply_meta(op)
        self.record(rec.Meta(op))
        return self.log.end

    def create_topic_now(self, namespace: str, name: str, config: TopicConfig) -> Topic:
        self.meta(
            op="topic_create",
            id=self.state.next_topic_id,
            ns=namespace,
            name=name,
            config=config_to_json(config),
            ms=self.now(),
        )
        return self.state.topics[(namespace, name)]


class EnginePart:
    """A part of the engine. The log and the state are never replaced, so each part
    keeps them at hand (they are on every call's path)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._log = core.log
        self._state = core.state
