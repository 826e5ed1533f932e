"""The commit log's ``fdatasync`` held from the test, to look at what the server or
engine does while a write waits for the disk (the engine runs in the test's own
process: the merged server, the separated form's storage nodes, a bare engine)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

__all__ = ["WAIT_S", "HeldFsync"]

WAIT_S = 30.0  # a bound on waiting for a condition, never a measured time


class HeldFsync:
    """Counts ``fdatasync`` calls and, while :attr:`armed` is set (from the start
    unless ``armed=False``), holds each one until :attr:`released` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, armed: bool = True) -> None:
        self.calls = 0
        self.armed = threading.Event()
        if armed:
            self.armed.set()
        self.entered = threading.Event()
        self.released = threading.Event()
        real = os.fdatasync

        def fdatasync(fd: int) -> None:
            self.calls += 1
            if self.armed.is_set():
                self.entered.set()
                self.released.wait(WAIT_S)
            real(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)

    async def wait_entered(self) -> None:
        """Until an fsync thread sits in a held ``fdatasync``."""
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, self.entered.wait, WAIT_S)
