"""Stopping a lease keeper stops its renewals, even when the stop's cancellation
arrives together with a renewal's answer (as nats-py's requests answer, through
``asyncio.wait_for``). A keeper that went on renewing held its shard for ever while
nobody served it: a hand-back in CI's kill test waited 90 s for a shard that never
came (python/cpython#86296)."""

from __future__ import annotations

import asyncio
from typing import cast

from nats.js import JetStreamContext

from polymq.storage.replicated.keeper import LeaseKeeper
from polymq.storage.replicated.leases import Lease, LeaseStore


class _AnsweredStore(LeaseStore):
    """Renewals the test answers, each awaited with ``asyncio.wait_for`` as nats-py
    awaits a request."""

    def __init__(self) -> None:
        super().__init__(cast(JetStreamContext, None), ttl_s=0.05, replicas=1)
        self.answers: list[asyncio.Future[int]] = []
        self.released: list[int] = []

    async def renew(self, lease: Lease) -> bool:
        answer = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        lease.revision = await asyncio.wait_for(answer, 10)
        return True

    async def release(self, lease: Lease) -> None:
        self.released.append(lease.revision)


async def test_stop_ends_the_renewals_when_its_cancel_comes_with_an_answer() -> None:
    store = _AnsweredStore()
    keeper = LeaseKeeper(store, Lease("shard-1", "node-1", 1, 1, store.ttl_s), lambda exc: None)
    keeper.start()
    async with asyncio.timeout(10):
        while not store.answers:
            await asyncio.sleep(0.001)
    store.answers[-1].set_result(2)
    async with asyncio.timeout(10) as guard:  # without the fix: the stop waits for ever
        await keeper.stop(release=True)  # cancels in the same step as the answer
    assert not guard.expired(), "the stop ended only when the guard cancelled it"
    asked = len(store.answers)
    await asyncio.sleep(store.ttl_s)  # a renewal is due every ttl/5
    assert len(store.answers) == asked, "the keeper renewed after it was stopped"
    assert store.released == [2]  # released at the revision of the last renewal
