"""A TCP proxy on loopback that keeps, per connection, what the client sent, in the
chunks it arrived in: the seeds of the fuzzer are real clients' sessions, not bytes
written by hand from the specifications."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

__all__ = ["Recorded", "RecordingProxy"]

_READ = 1 << 16


@dataclass(slots=True)
class Recorded:
    """One proxied connection: the client's chunks, in order."""

    chunks: list[bytes] = field(default_factory=list)
    closed: bool = False

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)


class RecordingProxy:
    """Listens on ``listen`` and forwards every connection to ``target``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self._listen = listen
        self._target = target
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections: list[Recorded] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, *self._listen)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        record = Recorded()
        self.connections.append(record)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(
                _pump(reader, up_writer, record.chunks), _pump(up_reader, writer, None)
            )
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            record.closed = True
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            self._tasks.discard(task)


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: list[bytes] | None
) -> None:
    try:
        while chunk := await reader.read(_READ):
            if keep is not None:
                keep.append(chunk)
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
