"""Publishing flow control: RabbitMQ's resource alarm.

While the alarm is engaged (by whatever watches a resource: a memory or disk
watermark, an operator, a test), a connection that publishes is no longer read, so
TCP pushes back on the publisher, and a client that announced the
``connection.blocked`` capability is told why with connection.blocked;
connection.unblocked follows when the alarm is released. As in RabbitMQ, connections
that only consume are not blocked. The listener owns one, passed in its options.
"""

from __future__ import annotations

import asyncio

__all__ = ["FlowControl"]


class FlowControl:
    """The alarm; change it on the gateway's event loop."""

    def __init__(self) -> None:
        self._released = asyncio.Event()
        self._released.set()
        self.reason = ""

    @property
    def engaged(self) -> bool:
        return not self._released.is_set()

    def engage(self, reason: str) -> None:
        self.reason = reason
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    async def wait_released(self) -> None:
        await self._released.wait()
