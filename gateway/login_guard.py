"""Failed logins: counted per protocol, logged without the secret, and slowed down per
source address.

An address that keeps failing waits longer and longer before it hears "no" (the
delay doubles with each consecutive failure past a few free ones, up to a cap), so
guessing passwords from one place gets slow, while a user who mistypes once feels
nothing. A success from the address forgets its failures, and so does a quiet spell.
Memory is bounded: at most ``max_addresses`` addresses are tracked, the least recently
failing one is forgotten first.

The guard only computes; the caller waits (on the injected clock), so a test checks
the delays without sleeping.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from polymq.storage.clock import Clock

__all__ = ["LoginGuard", "LoginGuardConfig"]

log = logging.getLogger(__name__)

_MAX_LOGGED_USER = 100  # a user name is peer-chosen: log at most this much of it


def peer_host(peer: str) -> str:
    """The address of a ``host:port`` or ``[v6]:port`` peer (as
    ``gateway.connections.peer_host``, which cannot be imported here: connections
    needs accounts, which needs this guard)."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return peer
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass(frozen=True, slots=True, kw_only=True)
class LoginGuardConfig:
    # Consecutive failures from one address answered at once (typos happen).
    free_failures: int = 2
    # The first slowed failure waits this long; each next one twice as long ...
    first_delay_ms: int = 100
    # ... up to this (kept under the handshake timeout, so a slowed but right
    # login on a shared address still finishes its handshake).
    max_delay_ms: int = 3000
    # Failures older than this are forgotten.
    forget_after_ms: int = 15 * 60 * 1000
    max_addresses: int = 10_000


@dataclass(slots=True)
class _Streak:
    failures: int
    last_ms: int


class LoginGuard:
    def __init__(self, config: LoginGuardConfig, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        # Address -> its current run of failures, least recently failed first.
        self._streaks: collections.OrderedDict[str, _Streak] = collections.OrderedDict()
        self._failed: dict[str, int] = {}

    @property
    def clock(self) -> Clock:
        return self._clock

    def failed(self, *, protocol: str, user: str | None, peer: str) -> int:
        """Record a failed login and log it (never the secret: it is not passed in).
        Returns how many milliseconds to wait before answering it."""
        self._failed[protocol] = self._failed.get(protocol, 0) + 1
        address = peer_host(peer)
        now = self._clock.now_ms()
        streak = self._streaks.pop(address, None)
        if streak is None or now - streak.last_ms > self._config.forget_after_ms:
            streak = _Streak(failures=0, last_ms=now)
        streak.failures += 1
        streak.last_ms = now
        self._streaks[address] = streak
        while len(self._streaks) > self._config.max_addresses:
            self._streaks.popitem(last=False)
        delay = self.delay_ms(streak.failures)
        log.warning(
            "login failed: protocol=%s user=%r peer=%s (%d in a row from this address%s)",
            protocol,
            (user or "")[:_MAX_LOGGED_USER],
            peer or "?",
            streak.failures,
            f", answered after {delay} ms" if delay else "",
        )
        return delay

    def succeeded(self, peer: str) -> None:
        """A success from ``peer``'s address forgets its failures."""
        self._streaks.pop(peer_host(peer), None)

    def delay_ms(self, consecutive_failures: int) -> int:
        """The wait before answering the ``consecutive_failures``-th failure in a row."""
        config = self._config
        slowed = consecutive_failures - config.free_failures
        if slowed <= 0:
            return 0
        # Capped before shifting: a long streak must not build a huge integer.
        return min(config.max_delay_ms, config.first_delay_ms << min(slowed - 1, 32))

    def failures(self) -> dict[str, int]:
        """Failed logins so far, by protocol (a counter: only grows)."""
        return dict(self._failed)

    def tracked_addresses(self) -> int:
        return len(self._streaks)
