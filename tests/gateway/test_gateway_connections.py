from __future__ import annotations

import asyncio

import pytest

from polymq.gateway.accounts import Principal
from polymq.gateway.connections import (
    ConnectionRegistry,
    TooManyConnections,
    current_connection_id,
    serving_connection,
)
from polymq.gateway.metering import Metering
from polymq.storage.clock import ManualClock

ALICE = Principal(name="alice", namespaces=frozenset({"a"}), default_namespace="a")


class Closable:
    def __init__(self) -> None:
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


def registry(limit: int = 10) -> tuple[ConnectionRegistry, Metering, ManualClock]:
    metering, clock = Metering(), ManualClock()
    return (
        ConnectionRegistry(max_connections=limit, metering=metering, clock=clock),
        metering,
        clock,
    )


def test_register_list_count() -> None:
    reg, _, clock = registry()
    a = reg.register(protocol="kafka", peer="127.0.0.1:1", close=Closable().close)
    clock.advance(5)
    b = reg.register(
        protocol="mqtt", peer="127.0.0.1:2", close=Closable().close, principal=ALICE, namespace="a"
    )
    assert a.id != b.id
    assert b.opened_ms == a.opened_ms + 5
    assert len(reg) == 2
    assert reg.count(protocol="kafka") == 1
    assert reg.count(namespace="a") == 1
    assert reg.list(protocol="mqtt") == [b]
    assert reg.get(a.id) == a
    reg.unregister(a.id)
    reg.unregister(a.id)  # a second close path is harmless
    assert reg.get(a.id) is None
    assert len(reg) == 1


def test_limit_refuses_then_admits_after_a_close() -> None:
    reg, _, _ = registry(limit=2)
    first = reg.register(protocol="amqp", peer="p1", close=Closable().close)
    reg.register(protocol="amqp", peer="p2", close=Closable().close)
    with pytest.raises(TooManyConnections, match="limit of 2"):
        reg.register(protocol="amqp", peer="p3", close=Closable().close)
    reg.unregister(first.id)
    reg.register(protocol="amqp", peer="p3", close=Closable().close)
    assert len(reg) == 2


def test_identify_moves_the_tenant_count() -> None:
    reg, metering, _ = registry()
    conn = reg.register(protocol="kafka", peer="p", close=Closable().close)
    assert metering.snapshot() == []  # nobody to bill before authentication
    named = reg.identify(conn.id, principal=ALICE, namespace="a", client_id="c-1")
    assert named.principal == ALICE and named.client_id == "c-1"
    assert reg.count(namespace="a") == 1
    [usage] = metering.snapshot()
    assert (usage.namespace, usage.connections, usage.connections_total) == ("a", 1, 1)
    reg.unregister(conn.id)
    assert metering.snapshot()[0].connections == 0


async def test_close_all_calls_every_close_and_survives_failures() -> None:
    reg, _, _ = registry()
    good = [Closable() for _ in range(3)]
    for c in good:
        reg.register(protocol="mqtt", peer="p", close=c.close)

    async def broken() -> None:
        raise RuntimeError("boom")

    reg.register(protocol="mqtt", peer="p", close=broken)
    await reg.close_all()
    assert [c.closed for c in good] == [1, 1, 1]
    assert len(reg) == 0


async def test_close_one() -> None:
    reg, _, _ = registry()
    target, other = Closable(), Closable()
    conn = reg.register(protocol="mqtt", peer="p", close=target.close)
    reg.register(protocol="mqtt", peer="q", close=other.close)
    await reg.close(conn.id)
    assert (target.closed, other.closed, len(reg)) == (1, 0, 1)


async def test_current_connection_is_per_task() -> None:
    seen: dict[int, int | None] = {}

    async def serve(conn_id: int) -> None:
        with serving_connection(conn_id):
            await asyncio.sleep(0)
            seen[conn_id] = current_connection_id()

    await asyncio.gather(serve(1), serve(2))
    assert seen == {1: 1, 2: 2}
    assert current_connection_id() is None
