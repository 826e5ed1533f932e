"""The nameserver over the real storage RPC on loopback, and the client's fan-out and
failover against real nameservers (some of them closed or silent)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest

from polymq.gateway.config import GatewayConfig, NameserverConfig, ServerConfig
from polymq.gateway.roles import serve_nameserver
from polymq.nameserver.client import NameserverClient, parse_address
from polymq.nameserver.server import Nameserver
from polymq.storage.clock import ManualClock
from polymq.storage.errors import InvalidArgument, InvalidName, StorageUnavailable
from polymq.storage.routes import NodeHeartbeat, RouteTable
from polymq.storage.rpc import RpcClient

WAIT_S = 10.0


def beat(node_id: str, *topics: str, port: int = 10911) -> NodeHeartbeat:
    return NodeHeartbeat(
        node_id=node_id, host="127.0.0.1", port=port, topics=tuple(("ns", t) for t in topics)
    )


def port_of(client: NameserverClient, index: int) -> int:
    return parse_address(client.addresses[index])[1]


def address(nameserver: Nameserver) -> str:
    host, port = nameserver.address
    return f"{host}:{port}"


@contextlib.asynccontextmanager
async def client_of(*nameservers: str, timeout_s: float = 2.0) -> AsyncIterator[NameserverClient]:
    client = NameserverClient(nameservers, timeout_s=timeout_s)
    try:
        yield client
    finally:
        await client.close()


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not await check():
            await asyncio.sleep(0.01)


async def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return port


async def test_nodes_heartbeat_and_gateways_read_routes_and_placements() -> None:
    async with Nameserver() as nameserver, client_of(address(nameserver)) as client:
        assert await client.heartbeat(beat("a", "t1")) == 1
        assert await client.heartbeat(beat("b", "t2", port=10912)) == 1
        table = await client.routes(0)
        assert isinstance(table, RouteTable)
        assert table.topics == {("ns", "t1"): "a", ("ns", "t2"): "b"}
        assert [(n.node_id, n.port) for n in table.nodes] == [("a", 10911), ("b", 10912)]
        assert await client.routes(table.version) is None
        assert await client.place_topic("ns", "t2") == "b"
        new = await client.place_topic("ns", "t3")
        assert new in ("a", "b")
        assert await client.place_topic("ns", "t3") == new
        home = await client.place_home("ns")
        assert await client.place_home("ns") == home
        status = await client.status()
        assert {n.node_id for n in status.nodes} == {"a", "b"}


async def test_silent_nodes_expire() -> None:
    clock = ManualClock()
    async with (
        Nameserver(node_expiry_ms=1000, clock=clock) as nameserver,
        client_of(address(nameserver)) as client,
    ):
        await client.heartbeat(beat("a", "t1"))
        await client.heartbeat(beat("b", "t2"))
        clock.advance(600)
        await client.heartbeat(beat("b", "t2"))
        clock.advance(600)  # a silent for 1200 ms, b for 600

        async def a_dead() -> bool:
            table = await client.routes(0)
            return table is not None and [(n.node_id, n.alive) for n in table.nodes] == [
                ("a", False),
                ("b", True),
            ]

        await eventually(a_dead)
        table = await client.routes(0)
        assert table is not None
        assert table.topics == {("ns", "t1"): "a", ("ns", "t2"): "b"}  # a's: down, not gone
        status = await client.status()
        assert {(n.node_id, n.alive) for n in status.nodes} == {("a", False), ("b", True)}


async def test_bad_requests_get_clear_errors_and_the_server_goes_on() -> None:
    async with Nameserver() as nameserver:
        host, port = nameserver.address
        rpc = RpcClient(host, port)
        try:
            with pytest.raises(InvalidArgument, match="NodeHeartbeat"):
                await rpc.call("heartbeat", {"node_id": "a"})
            with pytest.raises(InvalidArgument, match="port"):
                await rpc.call("heartbeat", replace(beat("a"), port=0))
            with pytest.raises(InvalidName):
                await rpc.call("place_topic", "ns", "")
            with pytest.raises(InvalidName):
                await rpc.call("place_home", 5)
            with pytest.raises(InvalidArgument, match="since_version"):
                await rpc.call("routes", "1")
            with pytest.raises(InvalidArgument, match="unknown method"):
                await rpc.call("drop_everything")
            with pytest.raises(StorageUnavailable, match="no live storage node"):
                await rpc.call("place_topic", "ns", "t")
            assert isinstance(await rpc.call("heartbeat", beat("a")), int)
            assert await rpc.call("place_topic", "ns", "t") == "a"
        finally:
            await rpc.close()


async def test_heartbeats_reach_every_nameserver_and_a_dead_one_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = f"127.0.0.1:{await free_port()}"
    async with Nameserver() as first, Nameserver() as second:
        async with client_of(address(first), dead, address(second)) as client:
            with caplog.at_level(logging.INFO, logger="polymq.nameserver.client"):
                for _ in range(3):
                    assert await client.heartbeat(beat("a", "t")) == 2
            # Logged once, not at every beat.
            assert len([r for r in caplog.records if dead in r.getMessage()]) == 1
        for nameserver in (first, second):
            table = nameserver.registry.routes(0)
            assert table is not None
            assert table.topics == {("ns", "t"): "a"}


async def test_questions_fail_over_to_the_next_nameserver_and_stay_there() -> None:
    async with (
        Nameserver() as first,
        Nameserver() as second,
        client_of(address(first), address(second)) as client,
    ):
        await client.heartbeat(beat("a", "t"))
        await client.routes(0)
        await first.close()
        table = await client.routes(0)  # first is gone: second answers
        assert table is not None
        assert table.topics == {("ns", "t"): "a"}
        assert await client.place_topic("ns", "t") == "a"
        # Sticky: with the first back (knowing nothing yet), the questions still go
        # to the one that answered, whose routes are whole.
        async with Nameserver(port=port_of(client, 0)):
            table = await client.routes(0)
            assert table is not None
            assert table.topics == {("ns", "t"): "a"}


async def test_no_nameserver_answering_is_unavailable() -> None:
    closed = [f"127.0.0.1:{await free_port()}" for _ in range(2)]
    async with client_of(*closed) as client:
        with pytest.raises(StorageUnavailable, match="no nameserver answered routes"):
            await client.routes(0)
        assert await client.heartbeat(beat("a")) == 0  # never raises


async def test_a_nameserver_that_never_answers_counts_as_down() -> None:
    """Accepts connections and reads, answers nothing: the timeout moves on."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    silent = await asyncio.start_server(swallow, "127.0.0.1", 0)
    silent_address = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    try:
        async with (
            Nameserver() as nameserver,
            client_of(silent_address, address(nameserver), timeout_s=1.0) as client,
        ):
            assert await client.heartbeat(beat("a", "t")) == 1
            table = await client.routes(0)
            assert table is not None
            assert table.topics == {("ns", "t"): "a"}
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


async def test_a_restarted_nameserver_rebuilds_from_the_next_heartbeats() -> None:
    first = Nameserver()
    await first.start()
    host, port = first.address
    async with client_of(f"{host}:{port}") as client:
        await client.heartbeat(beat("a", "t1"))
        await client.heartbeat(beat("b", "t2"))
        before = await client.routes(0)
        assert before is not None
        await first.close()
        async with Nameserver(port=port):
            # Reconnects by itself (the old connection is found dead by using it, and
            # the beat is sent again); the routes come back with the heartbeats.
            assert await client.heartbeat(beat("a", "t1")) == 1
            assert await client.heartbeat(beat("b", "t2")) == 1
            after = await client.routes(before.version)
            assert after is not None
            assert after.topics == before.topics
            assert after.version != before.version


def test_parse_address() -> None:
    assert parse_address("ns1:9876") == ("ns1", 9876)
    assert parse_address("[::1]:9876") == ("::1", 9876)
    for bad in ("ns1", "ns1:", ":9876", "ns1:port", "ns1:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_address(bad)
    with pytest.raises(ValueError):
        NameserverClient([])
    assert NameserverClient("h:1").addresses == ("h:1",)


async def test_serve_nameserver_logs_its_address_and_ready(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = GatewayConfig(
        server=ServerConfig(host="127.0.0.1"),
        nameserver=NameserverConfig(port=0, node_expiry_ms=5000),
    )
    stop = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="polymq.gateway.roles"):
        task = asyncio.create_task(serve_nameserver(config, stop))

        async def ready() -> bool:
            if task.done():
                await task
            return any(r.getMessage() == "ready" for r in caplog.records)

        await eventually(ready)
        line = next(r.getMessage() for r in caplog.records if "listening on" in r.getMessage())
        match = re.search(r"listening on ([\d.]+):(\d+)", line)
        assert match is not None
        async with client_of(f"{match[1]}:{match[2]}") as client:
            await client.heartbeat(beat("a", "t"))
            assert await client.place_topic("ns", "t") == "a"
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
    assert any(r.getMessage() == "stopped" for r in caplog.records)
