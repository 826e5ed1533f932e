"""Per-account quotas: produce and consume bytes per second, requests per second and
concurrent connections, and the per-account usage behind ``/metrics``.

Rates are token buckets holding one second's worth of tokens, refilled continuously
from the injected clock. A charge is always taken, even past empty: the bytes have
already arrived (or been read from storage), so, as Kafka does (KIP-13, and the token
bucket of KIP-599), the request is served and the account goes into debt; the debt
divided by the rate is the *throttle time*, how long the account's connections must
pause before they go on. Each protocol pauses its own way (Kafka's throttle_time_ms
and muted channel, AMQP's connection.blocked, MQTT's slow reads, HTTP 429, RocketMQ's
TOO_MANY_REQUESTS: docs/quotas.md), which is the adapters' business, not this module's.

Quotas are per gateway process, as Kafka's are per broker: an account connected to
three gateways may use three times its rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from polymq.gateway.accounts import Principal
from polymq.gateway.config import AuthConfig, QuotaConfig, QuotasConfig
from polymq.storage.clock import Clock, SystemClock

__all__ = ["UNLIMITED", "AccountQuota", "Kind", "QuotaUsage", "Quotas", "TokenBucket"]

Kind = Literal["produce", "consume", "requests"]

UNLIMITED = QuotaConfig()
_BURST_MS = 1000  # tokens a bucket holds: this long at its rate


class TokenBucket:
    """``rate`` tokens per second, at most one second's worth banked. :meth:`charge`
    may take the bucket below zero; :meth:`wait_ms` is then how long until it is back
    at zero, the throttle time."""

    def __init__(self, rate: int, clock: Clock) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate
        self._clock = clock
        self._capacity = rate * _BURST_MS / 1000
        self._tokens = self._capacity
        self._at = clock.now_ms()

    def _refill(self) -> None:
        now = self._clock.now_ms()
        if now > self._at:
            self._tokens = min(self._capacity, self._tokens + self.rate * (now - self._at) / 1000)
        self._at = max(self._at, now)

    def charge(self, amount: int) -> int:
        """Take ``amount`` tokens; returns the throttle time in ms (0 if none owed)."""
        self._refill()
        self._tokens -= amount
        return self._owed_ms()

    def wait_ms(self) -> int:
        """Ms until the bucket is out of debt (0 if it is not in debt)."""
        self._refill()
        return self._owed_ms()

    def _owed_ms(self) -> int:
        return math.ceil(-self._tokens * 1000 / self.rate) if self._tokens < 0 else 0


@dataclass(slots=True)
class _Counters:
    produce_bytes: int = 0
    consume_bytes: int = 0
    requests: int = 0
    throttled: int = 0
    throttle_ms: int = 0
    refused: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotaUsage:
    """One (account, protocol) pair's counters at snapshot time; all only grow."""

    account: str
    protocol: str
    produce_bytes: int = 0
    consume_bytes: int = 0
    requests: int = 0
    throttled: int = 0  # times a client was held back (or refused) over a rate
    throttle_ms: int = 0  # the throttle time asked of it, in all
    refused: int = 0  # connections refused at the account's connection limit


class AccountQuota:
    """One account's buckets and counters. Every charge is counted (bytes and
    requests per account are metrics even without limits) and returns the throttle
    time it leaves the account owing. *Throttled* counts what the protocols did about
    it (a throttle time sent, reads paused, deliveries held, a request refused):
    :meth:`throttled` and :meth:`hold` record it where the client is held back."""

    def __init__(self, name: str, limits: QuotaConfig, clock: Clock) -> None:
        self.name = name
        self.limits = limits
        self._clock = clock
        self._buckets: dict[Kind, TokenBucket | None] = {
            "produce": _bucket(limits.produce_bytes_per_s, clock),
            "consume": _bucket(limits.consume_bytes_per_s, clock),
            "requests": _bucket(limits.requests_per_s, clock),
        }
        self._counters: dict[str, _Counters] = {}

    @property
    def limited(self) -> bool:
        return self.limits != UNLIMITED

    def _get(self, protocol: str) -> _Counters:
        counters = self._counters.get(protocol)
        if counters is None:
            counters = self._counters[protocol] = _Counters()
        return counters

    def produced(self, protocol: str, nbytes: int, *, requests: int = 0) -> int:
        """Bytes a producer sent (and ``requests`` requests that carried them)."""
        c = self._get(protocol)
        c.produce_bytes += nbytes
        owed = self._charge("produce", nbytes)
        if requests:
            c.requests += requests
            owed = max(owed, self._charge("requests", requests))
        return owed

    def consumed(self, protocol: str, nbytes: int) -> int:
        """Bytes handed to a consumer."""
        c = self._get(protocol)
        c.consume_bytes += nbytes
        return self._charge("consume", nbytes)

    def requested(self, protocol: str, count: int = 1) -> int:
        """Requests (operations) of any kind."""
        c = self._get(protocol)
        c.requests += count
        return self._charge("requests", count)

    def wait_ms(self, *kinds: Kind) -> int:
        """How long the account still owes on ``kinds`` (all if none given), without
        charging anything: what a connection waits before it reads or sends more."""
        owed = 0
        for kind in kinds or ("produce", "consume", "requests"):
            bucket = self._buckets[kind]
            if bucket is not None:
                owed = max(owed, bucket.wait_ms())
        return owed

    async def wait(self, *kinds: Kind) -> None:
        """Sleep (on the injected clock) until the account owes nothing on ``kinds``."""
        while owed := self.wait_ms(*kinds):
            await self._clock.sleep_until(self._clock.now_ms() + owed)

    async def hold(self, protocol: str, *kinds: Kind) -> int:
        """Hold the caller back (it reads or delivers nothing meanwhile) until the
        account owes nothing on ``kinds``; counted as throttled if it had to wait.
        Returns the time owed when called."""
        owed = self.wait_ms(*kinds)
        if owed:
            self.throttled(protocol, owed)
            await self.wait(*kinds)
        return owed

    def refused(self, protocol: str) -> None:
        """A connection refused at the account's connection limit."""
        self._get(protocol).refused += 1

    def throttled(self, protocol: str, owed_ms: int) -> None:
        """A client held back for ``owed_ms`` (Kafka's throttle time sent) or refused
        while the account owed it (HTTP 429, RocketMQ 42900)."""
        if owed_ms > 0:
            c = self._get(protocol)
            c.throttled += 1
            c.throttle_ms += owed_ms

    def _charge(self, kind: Kind, amount: int) -> int:
        bucket = self._buckets[kind]
        return 0 if bucket is None or amount <= 0 else bucket.charge(amount)

    def snapshot(self) -> list[QuotaUsage]:
        return [
            QuotaUsage(account=self.name, protocol=protocol, **_fields(c))
            for protocol, c in sorted(self._counters.items())
        ]


class Quotas:
    """Every account's :class:`AccountQuota`, made on first use: an account's own
    ``quota``, else ``[quotas] default`` (which also covers the anonymous principal of
    open mode)."""

    def __init__(
        self,
        quotas: QuotasConfig | None = None,
        auth: AuthConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._default = (quotas or QuotasConfig()).default
        self._own = {
            a.user: a.quota for a in (auth.accounts if auth else ()) if a.quota is not None
        }
        self._clock: Clock = clock or SystemClock()
        self._accounts: dict[str, AccountQuota] = {}

    def limits(self, principal: Principal) -> QuotaConfig:
        return self._own.get(principal.name, self._default)

    def of(self, principal: Principal) -> AccountQuota:
        quota = self._accounts.get(principal.name)
        if quota is None:
            quota = self._accounts[principal.name] = AccountQuota(
                principal.name, self.limits(principal), self._clock
            )
        return quota

    def connection_limit(self, principal: Principal) -> int | None:
        return self.limits(principal).connections

    def snapshot(self) -> list[QuotaUsage]:
        """Plain data, sorted by account then protocol."""
        return [u for name in sorted(self._accounts) for u in self._accounts[name].snapshot()]


def _bucket(rate: int | None, clock: Clock) -> TokenBucket | None:
    return None if rate is None else TokenBucket(rate, clock)


def _fields(c: _Counters) -> dict[str, int]:
    return {f.name: getattr(c, f.name) for f in fields(c)}
