"""What the gateway tests put under the gateway: real storage, watched.

:class:`RecordedStorage` is the ``memory://`` engine (the real engine over a scratch
directory in memory) with a record of the calls that reached it, so a test can check
what the gateway passed down (or that nothing reached storage) without a hand-typed
stand-in for the storage API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from polymq.gateway.listeners import ListenerContext, TcpListener
from polymq.storage.memory import MemoryEngine


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class RecordedStorage:
    """A :class:`MemoryEngine` that lists every storage call made on it, in order."""

    def __init__(self) -> None:
        self.engine = MemoryEngine()
        self.calls: list[Call] = []
        self.started = False
        self.closed = False

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.engine, name)

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(Call(name, args, kwargs))
            return await method(*args, **kwargs)

        return recorded

    async def start(self) -> None:
        await self.engine.start()
        self.started = True

    async def close(self) -> None:
        await self.engine.close()
        self.closed = True

    def names(self) -> list[str]:
        return [call.name for call in self.calls]


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo lines back; a protocol handler small enough to see the transport work."""
    while line := await reader.readline():
        writer.write(line)
        await writer.drain()


def echo_listener(context: ListenerContext) -> TcpListener:
    """A listener factory as protocols provide them, serving :func:`echo`."""
    return TcpListener(
        name=context.name,
        host=context.host,
        port=context.port,
        handler=echo,
        connections=context.connections,
    )
