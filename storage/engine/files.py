"""File-system helpers shared by the engine's writers."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_directory"]


def fsync_directory(directory: Path) -> None:
    """Make created, renamed and deleted names in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_snapshot(directory: Path) -> dict[str, Any] | None:
    path = directory / _NAME
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as handle:
        state = json.load(handle)
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a checkpoint")
    return state
