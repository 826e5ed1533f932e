"""Fair limits: idle sockets of one protocol, or of one address, cannot lock the others
out of a real server; and the two tools of ``gateway.fairness`` (the shared frame
budget and cooperative slicing) do what the listeners rely on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pika
import pika.exceptions
import pytest

from polymq.gateway.fairness import FrameBudget, cooperatively
from tests.kafka.raw import RawKafka
from tests.live_server import LiveServer, live_server

LISTENERS = ("kafka", "amqp", "http")
TIMEOUT = 10.0


# -- helpers -------------------------------------------------------------------------


def _count(server: LiveServer, protocol: str | None = None) -> int:
    async def count() -> int:
        return server.gateway.connections.count(protocol=protocol)

    return server.call(count)


def _wait_count(server: LiveServer, expected: int, protocol: str | None = None) -> None:
    """Until the server's registry holds ``expected`` connections (accepting is
    asynchronous: a socket is connected before the server has registered it)."""
    deadline = time.monotonic() + TIMEOUT
    while (got := _count(server, protocol)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{got} {protocol or 'all'} connections, not {expected}")
        time.sleep(0.02)


@contextlib.contextmanager
def _idle_sockets(
    address: tuple[str, int], count: int, source: str | None = None
) -> Iterator[list[socket.socket]]:
    """``count`` connected sockets that send nothing."""
    socks = [
        socket.create_connection(
            address, timeout=TIMEOUT, source_address=(source, 0) if source else None
        )
        for _ in range(count)
    ]
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _refused(address: tuple[str, int], source: str | None = None) -> bool:
    """Whether the server closes a fresh connection without a word (what a listener
    does to a connection over a limit)."""
    with socket.create_connection(
        address, timeout=TIMEOUT, source_address=(source, 0) if source else None
    ) as sock:
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


def _kafka_answers(server: LiveServer, source: str | None = None) -> bool:
    with RawKafka(*server.address("kafka"), timeout=TIMEOUT) as client:
        if source is not None:  # the same request, from another source address
            client.sock.close()
            client.sock = socket.create_connection(
                server.address("kafka"), timeout=TIMEOUT, source_address=(source, 0)
            )
        response = client.request(
            18, 3, {"client_software_name": "t", "client_software_version": "1"}
        )
        return {k.api_key for k in response.api_keys} >= {0, 1, 3}


def _amqp_connects(server: LiveServer) -> bool:
    host, port = server.address("amqp")
    params = pika.ConnectionParameters(
        host=host, port=port, connection_attempts=1, socket_timeout=TIMEOUT
    )
    try:
        connection = pika.BlockingConnection(params)
    except pika.exceptions.AMQPConnectionError:
        return False
    try:
        channel = connection.channel()
        channel.queue_declare("", exclusive=True)
        return True
    finally:
        connection.close()


def _http_answers(server: LiveServer) -> bool:
    host, port = server.address("http")
    try:
        return httpx.get(f"http://{host}:{port}/healthz", timeout=TIMEOUT).status_code == 200
    except httpx.TransportError:
        return False


# -- connection limits over real sockets -------------------------------------------


def test_per_protocol_limit_leaves_the_other_protocols_room(tmp_path: Path) -> None:
    overrides = {"limits.max_connections_per_protocol": "3"}
    with live_server(tmp_path, LISTENERS, overrides=overrides) as server:
        with _idle_sockets(server.address("kafka"), 3):
            _wait_count(server, 3, "kafka")
            assert _refused(server.address("kafka"))
            assert _amqp_connects(server)
            assert _http_answers(server)
        _wait_count(server, 0, "kafka")
        assert _kafka_answers(server)  # the slots came back with the sockets


def test_per_address_limit_spares_other_addresses(tmp_path: Path) -> None:
    overrides = {"limits.max_connections_per_address": "3"}
    with live_server(tmp_path, LISTENERS, overrides=overrides) as server:
        with _idle_sockets(server.address("kafka"), 3, source="127.0.0.1"):
            _wait_count(server, 3)
            # Any protocol from the same address is over its limit...
            assert _refused(server.address("kafka"), source="127.0.0.1")
            assert not _amqp_connects(server)
            assert not _http_answers(server)
            # ...while another address still gets served.
            assert _kafka_answers(server, source="127.0.0.2")
        _wait_count(server, 0)
        assert _amqp_connects(server)


def test_global_limit_counts_every_protocol(tmp_path: Path) -> None:
    overrides = {"limits.max_connections": "3"}
    with (
        live_server(tmp_path, LISTENERS, overrides=overrides) as server,
        _idle_sockets(server.address("kafka"), 2) as kafka,
    ):
        with _idle_sockets(server.address("amqp"), 1):
            _wait_count(server, 3)
            assert _refused(server.address("kafka"))
            assert not _amqp_connects(server)
            assert not _http_answers(server)
        _wait_count(server, 2)
        assert _http_answers(server)  # one slot free again: any protocol may take it
        kafka[0].close()
        _wait_count(server, 1)
        assert _amqp_connects(server)


# -- FrameBudget -------------------------------------------------------------------


async def _spin(times: int = 5) -> None:
    """Let every ready task run a few times: a task still blocked after this is
    waiting on something, not on its turn."""
    for _ in range(times):
        await asyncio.sleep(0)


class _Holder:
    """A task holding ``size`` bytes of ``budget`` until released."""

    def __init__(self, budget: FrameBudget, size: int) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.task = asyncio.create_task(self._hold(budget, size))

    async def _hold(self, budget: FrameBudget, size: int) -> None:
        async with budget.reserve(size):
            self.entered.set()
            await self.release.wait()


async def test_budget_admits_up_to_its_size_then_waits() -> None:
    budget = FrameBudget(100)
    a, b = _Holder(budget, 60), _Holder(budget, 40)
    await _spin()
    assert a.entered.is_set() and b.entered.is_set()
    assert budget.held == 100
    c = _Holder(budget, 1)
    await _spin()
    assert not c.entered.is_set()  # one byte over: it waits, it does not fail
    assert budget.held == 100
    a.release.set()
    await asyncio.wait_for(c.entered.wait(), TIMEOUT)  # woken by the release
    assert budget.held == 41
    b.release.set()
    c.release.set()
    await asyncio.gather(a.task, b.task, c.task)
    assert budget.held == 0


async def test_budget_wakes_every_waiter_that_fits() -> None:
    budget = FrameBudget(10)
    big = _Holder(budget, 10)
    await _spin()
    small = [_Holder(budget, 5) for _ in range(2)]
    await _spin()
    assert not any(s.entered.is_set() for s in small)
    big.release.set()
    await asyncio.wait_for(asyncio.gather(*(s.entered.wait() for s in small)), TIMEOUT)
    assert budget.held == 10
    for s in small:
        s.release.set()
    await asyncio.gather(big.task, *(s.task for s in small))
    assert budget.held == 0


async def test_budget_given_back_when_a_holder_is_cancelled() -> None:
    budget = FrameBudget(10)
    holder = _Holder(budget, 10)
    await _spin()
    waiter = _Holder(budget, 10)
    await _spin()
    assert not waiter.entered.is_set()
    holder.task.cancel()  # a connection closed mid-frame
    with pytest.raises(asyncio.CancelledError):
        await holder.task
    await asyncio.wait_for(waiter.entered.wait(), TIMEOUT)
    assert budget.held == 10
    waiter.release.set()
    await waiter.task
    assert budget.held == 0


async def test_budget_waiter_cancelled_while_waiting_holds_nothing() -> None:
    budget = FrameBudget(10)
    holder = _Holder(budget, 10)
    await _spin()
    waiter = _Holder(budget, 5)
    await _spin()
    waiter.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter.task
    assert budget.held == 10
    holder.release.set()
    await holder.task
    assert budget.held == 0
    after = _Holder(budget, 10)  # no stale waiter or bytes left behind
    await asyncio.wait_for(after.entered.wait(), TIMEOUT)
    after.release.set()
    await after.task


async def test_frame_larger_than_the_budget_is_admitted_alone() -> None:
    budget = FrameBudget(100)
    small = _Holder(budget, 1)
    await _spin()
    huge = _Holder(budget, 500)
    await _spin()
    assert not huge.entered.is_set()  # not while anything else is held...
    small.release.set()
    await asyncio.wait_for(huge.entered.wait(), TIMEOUT)  # ...then alone
    assert budget.held == 500
    other = _Holder(budget, 1)
    await _spin()
    assert not other.entered.is_set()  # and nothing joins it
    huge.release.set()
    await asyncio.wait_for(other.entered.wait(), TIMEOUT)
    other.release.set()
    await asyncio.gather(small.task, huge.task, other.task)
    assert budget.held == 0


def test_budget_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        FrameBudget(0)

    async def negative() -> None:
        async with FrameBudget(10).reserve(-1):
            pass

    with pytest.raises(ValueError):
        asyncio.run(negative())


# -- cooperatively -------------------------------------------------------------------


async def test_cooperatively_lets_other_tasks_run_between_slices() -> None:
    ticks = 0
    stop = asyncio.Event()

    async def other_connection() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_connection())
    await _spin()
    seen: list[int] = []
    async for _ in cooperatively(range(1000), every=256):
        seen.append(ticks)  # the big request's work: no await of its own
    stop.set()
    await other
    # The other task ran after items 256, 512 and 768, and never inside a slice.
    assert len(set(seen[:256])) == 1
    assert seen[256] > seen[255] and seen[512] > seen[511] and seen[768] > seen[767]
    assert len(set(seen)) == 4


async def test_cooperatively_yields_every_item_in_order() -> None:
    items: list[object] = [object() for _ in range(600)]
    assert [x async for x in cooperatively(items)] == items
    nothing: list[int] = []
    assert [x async for x in cooperatively(nothing)] == []
