"""Seed and regression files: what one client sent on one connection, as text.

One line per chunk (what the client wrote in one go, hex), ``#`` lines are comments.
Text rather than binary so that a regression file says in review what it holds and
why, and so that a diff of a re-recorded session is readable; the sessions are small
(kilobytes), so doubling their size costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HERE",
    "PROTOCOLS",
    "REGRESSIONS",
    "SESSIONS",
    "Session",
    "dump",
    "load",
    "load_dir",
]

HERE = Path(__file__).resolve().parent
SESSIONS = HERE / "sessions"
REGRESSIONS = HERE / "regressions"
# Listener names, in the order the fuzzer reports them.
PROTOCOLS: tuple[str, ...] = ("kafka", "amqp", "mqtt", "mqtt_ws", "rocketmq", "http")


@dataclass(frozen=True, slots=True)
class Session:
    """A client's byte stream to one listener, in the chunks it wrote."""

    protocol: str
    name: str
    chunks: tuple[bytes, ...]
    comment: str = ""

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


def dump(session: Session, path: Path) -> None:
    lines = [f"# {line}" for line in session.comment.splitlines()]
    lines += [chunk.hex() for chunk in session.chunks if chunk]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def load(path: Path, protocol: str | None = None) -> Session:
    """``protocol`` defaults to the name of the file's folder."""
    comment: list[str] = []
    chunks: list[bytes] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            comment.append(line[1:].strip())
        else:
            chunks.append(bytes.fromhex(line))
    return Session(
        protocol=protocol or path.parent.name,
        name=path.stem,
        chunks=tuple(chunks),
        comment="\n".join(comment),
    )


def load_dir(root: Path, protocols: Sequence[str] = PROTOCOLS) -> dict[str, list[Session]]:
    """Every ``*.hex`` file under ``root/<protocol>/``, by protocol (sorted by name)."""
    return {
        protocol: [load(p, protocol) for p in sorted((root / protocol).glob("*.hex"))]
        for protocol in protocols
    }
