"""What the matrix asks of each protocol: produce one message, consume one message.

A driver wraps one real client library and stays connected across cells (client
start-up dominates a cell's time otherwise). ``prepare`` runs before the producer sends,
so a consumer that only sees what arrives after it subscribed (MQTT, an AMQP queue)
is in place, and a consumer whose protocol fixes the topic's shape (an MNS queue: one
storage queue) creates it first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from polymq.conformance.interop.fields import Arrived, Sent

__all__ = ["Driver", "poll"]

_T = TypeVar("_T")


class Driver(Protocol):
    protocol: str
    client: str

    def prepare(self, topic: str) -> None:
        """Get ready to consume what is produced to ``topic`` from now on."""

    def produce(self, topic: str, sent: Sent) -> None:
        """Send one message to ``topic`` and return once the server acknowledged it."""

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        """The first message of ``topic`` (acknowledged), normalized."""

    def close(self) -> None: ...


def poll(take: Callable[[float], _T | None], timeout_s: float, what: str) -> _T:
    """Call ``take(remaining_s)`` until it returns something, or fail after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no message arrived through {what} within {timeout_s:.0f} s")
        got = take(remaining)
        if got is not None:
            return got
