"""The quota mechanism on an injected clock: throttle times computed as Kafka's token
bucket computes them, per-account limits and defaults, connection limits in the
registry. No sockets, no sleeping: the clock moves when the test says."""

from __future__ import annotations

import asyncio

import pytest

from polymq.gateway.accounts import ANONYMOUS, Principal
from polymq.gateway.config import AccountConfig, AuthConfig, QuotaConfig, QuotasConfig
from polymq.gateway.connections import AccountConnectionLimit, ConnectionRegistry
from polymq.gateway.metering import Metering
from polymq.gateway.quotas import UNLIMITED, Quotas, TokenBucket
from polymq.storage.clock import ManualClock

ALICE = Principal(name="alice", namespaces=frozenset({"a"}), default_namespace="a")
BOB = Principal(name="bob", namespaces=frozenset({"b"}), default_namespace="b")


def quotas(clock: ManualClock, *, default: QuotaConfig = UNLIMITED) -> Quotas:
    auth = AuthConfig(
        mode="accounts",
        accounts=(
            AccountConfig(
                user="alice",
                password="pw",
                quota=QuotaConfig(produce_bytes_per_s=1000, requests_per_s=10, connections=2),
            ),
            AccountConfig(user="bob", password="pw"),
        ),
    )
    return Quotas(QuotasConfig(default=default), auth, clock)


def test_bucket_debt_is_the_throttle_time() -> None:
    clock = ManualClock()
    bucket = TokenBucket(1000, clock)  # 1000 tokens/s, one second banked
    assert bucket.charge(1000) == 0  # the burst
    assert bucket.charge(500) == 500  # 500 tokens owed at 1000/s
    clock.advance(200)
    assert bucket.wait_ms() == 300
    clock.advance(300)
    assert bucket.wait_ms() == 0
    clock.advance(10_000)  # refills to one second's worth, no more
    assert bucket.charge(3000) == 2000


def test_an_account_quota_counts_and_throttles() -> None:
    clock = ManualClock()
    q = quotas(clock).of(ALICE)
    assert q.produced("kafka", 800, requests=1) == 0
    assert q.produced("kafka", 700, requests=1) == 500
    assert q.wait_ms("produce") == 500
    assert q.wait_ms("consume") == 0  # no consume limit
    assert q.consumed("kafka", 10**9) == 0
    (usage,) = q.snapshot()
    assert (usage.produce_bytes, usage.consume_bytes, usage.requests) == (1500, 10**9, 2)
    assert (usage.throttled, usage.throttle_ms) == (0, 0)  # until a protocol acts on it
    q.throttled("kafka", 500)  # e.g. the throttle time sent
    (usage,) = q.snapshot()
    assert (usage.throttled, usage.throttle_ms) == (1, 500)


async def test_hold_returns_once_the_debt_is_paid_and_counts_it() -> None:
    clock = ManualClock()
    q = quotas(clock).of(ALICE)
    assert await q.hold("amqp", "produce") == 0  # nothing owed: no wait, not counted
    q.produced("amqp", 1500)
    waiter = asyncio.create_task(q.hold("amqp", "produce"))
    await asyncio.sleep(0)
    clock.advance(499)
    await asyncio.sleep(0)
    assert not waiter.done()
    clock.advance(1)
    assert await asyncio.wait_for(waiter, 5) == 500
    (usage,) = q.snapshot()
    assert (usage.throttled, usage.throttle_ms) == (1, 500)


def test_accounts_without_a_quota_get_the_default() -> None:
    clock = ManualClock()
    none = quotas(clock)
    assert not none.of(BOB).limited
    assert not none.of(ANONYMOUS).limited
    default = QuotaConfig(requests_per_s=1)
    some = quotas(clock, default=default)
    assert some.limits(BOB) == default
    assert some.limits(ANONYMOUS) == default  # open mode's principal too
    assert some.limits(ALICE).produce_bytes_per_s == 1000  # its own wins
    assert some.of(ANONYMOUS).requested("http") == 0
    assert some.of(ANONYMOUS).requested("http") == 1000


def test_the_registry_refuses_an_account_over_its_connections() -> None:
    clock = ManualClock()
    q = quotas(clock)
    registry = ConnectionRegistry(max_connections=100, metering=Metering(), clock=clock, quotas=q)

    async def close() -> None:
        pass

    ids = [registry.register(protocol="amqp", peer=f"h:{i}", close=close).id for i in range(4)]
    registry.identify(ids[0], principal=ALICE, namespace="a")
    registry.identify(ids[1], principal=ALICE, namespace="a")
    registry.identify(ids[1], principal=ALICE, namespace="a")  # the same again: no new slot
    with pytest.raises(AccountConnectionLimit):
        registry.identify(ids[2], principal=ALICE, namespace="a")
    assert registry.get(ids[2]).principal is None  # type: ignore[union-attr]
    registry.identify(ids[3], principal=BOB, namespace="b")  # others carry on
    with pytest.raises(AccountConnectionLimit):
        registry.register(protocol="mqtt", peer="h:9", close=close, principal=ALICE)
    registry.unregister(ids[0])
    registry.identify(ids[2], principal=ALICE, namespace="a")  # a slot came free
    refused = {u.protocol: u.refused for u in q.of(ALICE).snapshot()}
    assert refused == {"amqp": 1, "mqtt": 1}
