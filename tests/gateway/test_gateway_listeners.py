from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from polymq.gateway.connections import ConnectionRegistry, current_connection_id
from polymq.gateway.listeners import ListenerSet, TcpListener
from polymq.gateway.metering import Metering
from polymq.storage.clock import SystemClock
from tests.gateway.gateway_fakes import echo

TIMEOUT = 5


async def roundtrip(port: int, payload: bytes = b"hello\n") -> bytes:
    """The server's first line back; b"" if it hung up (by FIN or, with our bytes
    unread, by RST)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), TIMEOUT)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionResetError):
            await writer.wait_closed()


async def test_port_zero_binds_a_free_port_and_sets_nodelay() -> None:
    nodelay: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        await echo(reader, writer)

    listener = TcpListener(name="echo", host="127.0.0.1", port=0, handler=handler)
    assert listener.address is None
    await listener.start()
    try:
        assert listener.address is not None
        host, port = listener.address
        assert host == "127.0.0.1" and port > 0
        assert listener.port == 0  # the configured port stays what was asked
        assert await roundtrip(port) == b"hello\n"
        assert nodelay == [1]
    finally:
        await listener.stop()
    assert listener.address is None


async def test_stop_closes_open_connections() -> None:
    started = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        started.set()
        await reader.read()  # never returns on its own: the client stays silent

    listener = TcpListener(name="idle", host="127.0.0.1", port=0, handler=handler)
    await listener.start()
    assert listener.address is not None
    port = listener.address[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.wait_for(started.wait(), TIMEOUT)
    assert listener.open_connections == 1
    await asyncio.wait_for(listener.stop(), TIMEOUT)
    assert listener.open_connections == 0
    assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""  # the server hung up
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_stop_does_not_wait_for_a_peer_that_stops_reading() -> None:
    flooding = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"x" * (64 << 20))  # far more than socket buffers hold
        flooding.set()
        await reader.read()

    listener = TcpListener(
        name="flood", host="127.0.0.1", port=0, handler=handler, close_grace_s=0.2
    )
    await listener.start()
    assert listener.address is not None
    _, writer = await asyncio.open_connection(*listener.address)  # never reads
    await asyncio.wait_for(flooding.wait(), TIMEOUT)
    await asyncio.wait_for(listener.stop(), TIMEOUT)
    writer.close()


async def test_handler_failure_closes_only_that_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        if line == b"crash\n":
            raise RuntimeError("a bug in one connection")
        writer.write(line)
        await writer.drain()
        await echo(reader, writer)

    listener = TcpListener(name="fragile", host="127.0.0.1", port=0, handler=handler)
    await listener.start()
    try:
        assert listener.address is not None
        port = listener.address[1]
        healthy_r, healthy_w = await asyncio.open_connection("127.0.0.1", port)
        healthy_w.write(b"first\n")
        assert await asyncio.wait_for(healthy_r.readline(), TIMEOUT) == b"first\n"
        assert await roundtrip(port, b"crash\n") == b""
        healthy_w.write(b"still here\n")
        assert await asyncio.wait_for(healthy_r.readline(), TIMEOUT) == b"still here\n"
        healthy_w.close()
        await healthy_w.wait_closed()
    finally:
        await listener.stop()


async def test_registry_tracks_connections_and_enforces_the_limit() -> None:
    registry = ConnectionRegistry(max_connections=1, metering=Metering(), clock=SystemClock())
    ids: list[int | None] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ids.append(current_connection_id())
        await echo(reader, writer)

    listener = TcpListener(
        name="kafka", host="127.0.0.1", port=0, handler=handler, connections=registry
    )
    await listener.start()
    try:
        assert listener.address is not None
        port = listener.address[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"one\n")
        assert await asyncio.wait_for(reader.readline(), TIMEOUT) == b"one\n"
        [conn] = registry.list()
        assert conn.protocol == "kafka" and conn.peer.startswith("127.0.0.1:")
        assert ids == [conn.id]

        assert await roundtrip(port, b"two\n") == b""  # over the limit: closed at once
        assert len(registry) == 1

        await registry.close_all()  # shutdown closes it through the transport
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        writer.close()
        assert await roundtrip(port, b"three\n") == b"three\n"  # room again
    finally:
        await listener.stop()
    assert len(registry) == 0


class Recording:
    """A listener that notes which others were running when it started and stopped."""

    def __init__(self, name: str, running: list[str], *, fail: bool = False) -> None:
        self.name = name
        self.port = 0
        self.address: tuple[str, int] | None = None
        self.running = running
        self.fail = fail
        self.seen_at_start: list[str] = []
        self.seen_at_stop: list[str] = []

    async def start(self) -> None:
        if self.fail:
            raise OSError("address in use")
        self.seen_at_start = list(self.running)
        self.running.append(self.name)
        self.address = ("127.0.0.1", 1)

    async def stop(self) -> None:
        self.running.remove(self.name)
        self.seen_at_stop = list(self.running)


async def test_listener_set_starts_in_order_and_stops_in_reverse() -> None:
    running: list[str] = []
    a, b, c = (Recording(n, running) for n in "abc")
    async with ListenerSet([a, b, c]) as listeners:
        assert running == ["a", "b", "c"]
        assert listeners.get("b") is b
        assert len(listeners) == 3
    assert running == []
    assert (a.seen_at_start, b.seen_at_start, c.seen_at_start) == ([], ["a"], ["a", "b"])
    # c stopped first (a and b still up), a last
    assert (c.seen_at_stop, b.seen_at_stop, a.seen_at_stop) == (["a", "b"], ["a"], [])


async def test_listener_set_failure_stops_those_started() -> None:
    running: list[str] = []
    listeners = ListenerSet(
        [Recording("a", running), Recording("b", running), Recording("c", running, fail=True)]
    )
    with pytest.raises(OSError, match="address in use"):
        await listeners.start()
    assert running == []


def test_listener_names_are_unique() -> None:
    with pytest.raises(ValueError, match="repeat"):
        ListenerSet([Recording("a", []), Recording("a", [])])
