"""Checkpoint files: the engine's non-log state at one commit-log position.

Written atomically (temporary file, fsync, rename, fsync of the directory) so a crash
leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from storage.engine.files import fsync_directory

__all__ = ["read_snapshot", "write_snapshot"]

_NAME = "checkpoint.json"


def write_snapshot(directory: Path, state: dict[str, Any]) -> None:
    path = directory / _NAME
    tmp = directory / (_NAME + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(state, handle, separators=(",", ":"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(directory)


def read_snapshot(directory: Path) -> dict[str, Any] | None:
    path = directory / _NAME
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as handle:
        state = json.load(handle)
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a checkpoint")
    return state
