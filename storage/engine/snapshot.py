"""Checkpoint files: the engine's non-log state at one commit-log position.

Each file is written atomically (temporary file, fsync, rename, fsync of the
directory) so a crash leaves either the old one or the new one, never half of one.
The checkpoint names the other files it relies on (the topics list, which is large
and rarely changes, is written only when it changed), so those are written first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from polymq.storage.engine.files import fsync_directory

__all__ = [
    "iter_json_lines",
    "read_json",
    "read_snapshot",
    "remove_stale",
    "write_json",
    "write_json_lines",
    "write_lines",
    "write_snapshot",
]

_NAME = "checkpoint.json"


def write_json(directory: Path, name: str, value: Any) -> None:
    path = directory / name
    tmp = directory / (name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(value, handle, separators=(",", ":"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(directory)


def write_json_lines(directory: Path, name: str, values: Iterable[Any]) -> None:
    """One JSON value per line: read back one at a time, a large list never has to be
    in memory twice (a parsed list of 100,000 topics costs more than the topics)."""
    write_lines(directory, name, (json.dumps(v, separators=(",", ":")) for v in values))


def write_lines(directory: Path, name: str, lines: Iterable[str]) -> None:
    """Lines already serialized as JSON (``iter_json_lines`` reads them back)."""
    path = directory / name
    tmp = directory / (name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line)
            handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(directory)


def iter_json_lines(directory: Path, name: str) -> Iterator[Any]:
    with open(directory / name, encoding="utf-8") as handle:
        for line in handle:
            yield json.loads(line)


def read_json(directory: Path, name: str) -> Any:
    with open(directory / name, encoding="utf-8") as handle:
        return json.load(handle)


def write_snapshot(directory: Path, state: dict[str, Any]) -> None:
    write_json(directory, _NAME, state)


def read_snapshot(directory: Path) -> dict[str, Any] | None:
    if not (directory / _NAME).exists():
        return None
    state = read_json(directory, _NAME)
    if not isinstance(state, dict):
        raise ValueError(f"{directory / _NAME} is not a checkpoint")
    return state


def remove_stale(directory: Path, pattern: str, keep: str) -> None:
    """Delete files matching ``pattern`` other than ``keep`` (after a new checkpoint)."""
    for path in directory.glob(pattern):
        if path.name != keep:
            path.unlink(missing_ok=True)
