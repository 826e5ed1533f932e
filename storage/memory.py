"""``memory://``: the embedded engine over a private directory in memory.

Tests and trials want storage that starts empty, costs no disk and leaves nothing
behind, yet behaves exactly as the real one. Rather than a second implementation of
the storage API (which would drift from the engine and need contract tests of its
own to stay honest), it is the engine itself over a scratch directory in ``/dev/shm``
(RAM on Linux; the system's temporary directory elsewhere), with ``async`` durability
since nothing outlives the process anyway, removed when the engine closes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from polymq.storage.clock import Clock
from polymq.storage.engine import Durability, Engine, EngineConfig

__all__ = ["MemoryEngine"]

_RAM = Path("/dev/shm")


def _scratch_dir() -> Path:
    parent = _RAM if _RAM.is_dir() and os.access(_RAM, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="polymq-memory-", dir=parent))


class MemoryEngine(Engine):
    """An :class:`Engine` whose data lives only as long as it does. ``config``'s data
    directory and durability are replaced; every other setting applies (the engine's
    defaults without one)."""

    def __init__(self, config: EngineConfig | None = None, *, clock: Clock | None = None) -> None:
        scratch = _scratch_dir()
        self.scratch = scratch
        # Removed at close, or when the engine is collected without being closed.
        self._cleanup = weakref.finalize(self, shutil.rmtree, scratch, ignore_errors=True)
        base = config or EngineConfig(data_dir=scratch)
        memory = dataclasses.replace(base, data_dir=scratch, durability=Durability.ASYNC)
        super().__init__(memory, clock=clock)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            self._cleanup()
