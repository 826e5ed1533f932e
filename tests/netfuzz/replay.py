"""Sending one :class:`~tests.netfuzz.mutate.Plan` on a fresh connection and reading
whatever the server answers, with a bound on every wait, so that the fuzzer itself
can never hang on a server that does."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from tests.netfuzz.mutate import Plan

__all__ = ["CONNECT_TIMEOUT_S", "Outcome", "replay"]

CONNECT_TIMEOUT_S = 3.0
# After the last write: how long the server may stay silent before we hang up (it
# got what it needs to answer or to close), and the longest a connection may last.
IDLE_S = 0.5
MAX_S = 8.0
WRITE_TIMEOUT_S = 3.0


@dataclass(slots=True)
class Outcome:
    connected: bool = False
    closed_by_server: bool = False
    received: int = 0
    sent: int = 0
    seconds: float = 0.0
    error: str | None = None
    # For a slow send: the server still had the connection open when we gave up.
    slow_kept_open: bool = False
    # Our end of the connection ("host:port", as the server lists its peer).
    local: str | None = None


async def replay(
    host: str,
    port: int,
    plan: Plan,
    *,
    slow_close_within_s: float = 6.0,
    idle_s: float = IDLE_S,
    max_s: float = MAX_S,
    source: str | None = None,
    on_connect: Callable[[str], None] | None = None,
) -> Outcome:
    """``slow_close_within_s``: for a slow plan, how long the server may keep a
    connection that never finished its handshake (its deadline, plus margin).
    ``source``: the local address to connect from; ``on_connect`` is given our end
    of the connection as soon as it is open."""
    outcome = Outcome()
    started = time.monotonic()
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(
                host, port, local_addr=(source, 0) if source else None
            )
    except (OSError, TimeoutError) as e:
        outcome.error = f"connect: {type(e).__name__}: {e}"
        return outcome
    outcome.connected = True
    sockname = writer.get_extra_info("sockname")
    if sockname:
        outcome.local = f"{sockname[0]}:{sockname[1]}"
        if on_connect is not None:
            on_connect(outcome.local)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    last_activity = time.monotonic()
    closed = asyncio.Event()

    async def read() -> None:
        nonlocal last_activity
        try:
            while chunk := await reader.read(1 << 16):
                outcome.received += len(chunk)
                last_activity = time.monotonic()
        except OSError:
            pass
        outcome.closed_by_server = True
        closed.set()

    reading = asyncio.create_task(read())
    limit = slow_close_within_s if plan.slow else max_s
    try:
        async with asyncio.timeout(limit):
            for pause, data in plan.writes:
                if pause:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(pause):
                            await closed.wait()
                if closed.is_set():
                    break
                writer.write(data)
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await writer.drain()
                outcome.sent += len(data)
                last_activity = time.monotonic()
            if plan.slow:
                await closed.wait()  # the server must hang up: we never finish
            else:
                while not closed.is_set():
                    quiet = idle_s - (time.monotonic() - last_activity)
                    if quiet <= 0:
                        break
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(quiet):
                            await closed.wait()
    except TimeoutError:
        if plan.slow and not closed.is_set():
            outcome.slow_kept_open = True
    except OSError as e:  # reset while writing: the server closed on us
        outcome.closed_by_server = True
        outcome.error = f"{type(e).__name__}"
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        writer.transport.abort()
        outcome.seconds = time.monotonic() - started
    return outcome
