"""Settings of the embedded engine."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

__all__ = ["Durability", "EngineConfig"]


class Durability(StrEnum):
    SYNC = "sync"  # fsync before acknowledging (group commit keeps it fast)
    ASYNC = "async"  # write before acknowledging, fsync every flush_interval_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    data_dir: Path
    durability: Durability = Durability.SYNC
    flush_interval_ms: int = 1000
    # A durable message is readable once written; only its append's answer waits for
    # the fsync (CommitLog's docstring). False: readable once fsynced.
    visible_before_fsync: bool = True
    segment_bytes: int = 128 << 20
    retention_ms: int = 7 * 24 * 3600 * 1000
    retention_bytes: int | None = None
    max_message_bytes: int = 16 << 20
    checkpoint_interval_ms: int = 30_000
    checkpoint_log_bytes: int = 256 << 20
    retention_check_interval_ms: int = 60_000
    dedup_window_ms: int = 5 * 60 * 1000  # SQS's deduplication interval
