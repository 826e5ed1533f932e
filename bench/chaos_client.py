"""What every chaos client shares: its thread, its pace, the gateways it may use, and
the reconnect habit (try the next gateway, a short pause, again).

Reconnecting is the application's job, not the server's: each protocol module writes
the small loop its client library needs on top of these.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

from bench.chaos_history import History

__all__ = ["Context", "Pacer", "Worker", "backoff", "describe", "join_all"]

Address = tuple[str, int]
log = logging.getLogger("bench.chaos")


@dataclass(frozen=True, slots=True)
class Context:
    """One protocol's share of a run. ``gateways`` maps a listener name to every
    gateway's address for it; the ports stay the same across restarts."""

    run: str
    protocol: str
    gateways: dict[str, tuple[Address, ...]]
    rate: float
    producers: int
    history: History
    stop_producing: threading.Event
    stop_consuming: threading.Event
    # Set by the consumer once it is subscribed (or has polled once): producers wait
    # for it, so nothing is sent before a subscription that would have kept it.
    subscribed: threading.Event

    def addresses(self, listener: str, attempt: int) -> list[Address]:
        """Every gateway, starting at a different one each attempt, so a client whose
        gateway died tries the other first instead of the dead one again."""
        every = list(self.gateways[listener])
        start = attempt % len(every)
        return every[start:] + every[:start]

    def wait_subscribed(self) -> bool:
        """``False`` if stopped before the consumer was ready."""
        while not self.subscribed.wait(0.2):
            if self.stop_producing.is_set():
                return False
        return True

    def name(self, role: str, index: int = 0) -> str:
        return f"{self.protocol}-{role}{index}"


class Pacer:
    """A steady ``rate`` per second that does not catch up after a stall: an outage
    shows as a gap, not as a burst that hides it."""

    def __init__(self, rate: float) -> None:
        self._every = 1.0 / rate
        self._next = time.monotonic()

    def wait(self, stop: threading.Event) -> bool:
        """Until the next slot; ``False`` once ``stop`` is set."""
        now = time.monotonic()
        self._next = max(self._next + self._every, now)
        return not stop.wait(max(self._next - now, 0.0))


def backoff(stop: threading.Event, seconds: float = 0.2) -> bool:
    """The pause between two connection attempts; ``False`` once ``stop`` is set."""
    return not stop.wait(seconds)


class Worker(threading.Thread):
    """One client (a producer or a consumer) in its own thread. A daemon: one whose
    library call hangs past the end of the run is reported as stuck and left behind
    instead of keeping the bench from exiting."""

    def __init__(self, name: str, context: Context) -> None:
        super().__init__(name=name, daemon=True)
        self.context = context
        self.history = context.history

    def run(self) -> None:
        try:
            self.work()
        except Exception as e:  # a bug of the bench, or a client library's surprise
            self.history.on_error(f"crashed: {type(e).__name__}")
            log.error("%s crashed:\n%s", self.name, traceback.format_exc())

    def work(self) -> None:
        raise NotImplementedError

    def error(self, e: BaseException | str, what: str = "") -> None:
        kind = e if isinstance(e, str) else describe(e)
        kind = f"{what} {kind}" if what else kind
        self.history.on_error(kind)
        log.info("%s: %s", self.name, kind)


def describe(e: BaseException) -> str:
    """One line, short enough to count alike errors together (a gRPC error's code
    and details, not its multi-line repr)."""
    code = getattr(e, "code", None)
    if callable(code) and callable(details := getattr(e, "details", None)):
        text = f"{code()} {details()}"
    else:
        text = str(e)
    return f"{type(e).__name__}: {' '.join(text.split())[:80]}"


def join_all(workers: Sequence[Worker], timeout: float) -> list[Worker]:
    """Join within ``timeout`` seconds in all; the ones still running."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.join(max(deadline - time.monotonic(), 0.0))
    return [w for w in workers if w.is_alive()]
