"""protocols/mqtt/deadlines.py: the one timer behind every connection's keep-alive and
handshake deadline asks each item when its deadline comes, files it again when the
item says it was heard from since, and forgets an item taken out. Waits are bounded
by conditions with timeouts; nothing asserts how long anything took."""

from __future__ import annotations

import asyncio

from polymq.protocols.mqtt.deadlines import TICK_S, Deadlines

TIMEOUT_S = 10.0


class _Item:
    """A connection as the deadlines see it: due at ``until``, pushed later by
    ``extensions`` times before it gives up."""

    def __init__(self, until: float, extensions: int = 0) -> None:
        self.deadline_tick = 0
        self.until = until
        self.extensions = extensions
        self.asked: list[float] = []
        self.expired = asyncio.Event()

    def due(self, now: float) -> float | None:
        self.asked.append(now)
        if now < self.until:
            return self.until  # not yet: ask again then
        if self.extensions:
            self.extensions -= 1
            self.until = now + TICK_S
            return self.until
        self.expired.set()
        return None


async def _expired(item: _Item) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        await item.expired.wait()


def test_an_item_is_asked_at_its_deadline_and_not_before() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        item = _Item(loop.time() + 2 * TICK_S)
        deadlines.add(item, item.until)
        await _expired(item)
        # Never asked before its deadline (a timer may fire a hair early).
        assert item.asked and min(item.asked) >= item.until - 0.01
        assert len(deadlines) == 0

    asyncio.run(main())


def test_an_item_heard_from_is_filed_again_until_it_expires() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        item = _Item(loop.time() + TICK_S, extensions=3)
        deadlines.add(item, item.until)
        await _expired(item)
        assert len(item.asked) >= 4  # asked once per extension, then expired

    asyncio.run(main())


def test_a_discarded_item_is_never_asked() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        gone = _Item(loop.time() + TICK_S)
        kept = _Item(loop.time() + 2 * TICK_S)
        deadlines.add(gone, gone.until)
        deadlines.add(kept, kept.until)
        deadlines.discard(gone)
        await _expired(kept)
        assert gone.asked == []

    asyncio.run(main())


def test_many_items_over_many_ticks_all_expire() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        now = loop.time()
        items = [_Item(now + (i % 5) * TICK_S) for i in range(200)]
        for item in reversed(items):  # later ones first: the timer moves earlier
            deadlines.add(item, item.until)
        await asyncio.gather(*(_expired(item) for item in items))
        assert len(deadlines) == 0

    asyncio.run(main())
