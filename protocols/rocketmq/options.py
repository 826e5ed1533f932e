"""Tunables of the RocketMQ adapter that an operator rarely touches.

Defaults are Apache RocketMQ's (proxy ``ProxyConfig``, broker ``BrokerConfig``); tests
pass shorter times through :class:`RocketMQOptions` rather than sleeping through the
real ones. The operator-facing switch (``auto_create``) lives in
``GatewayConfig.rocketmq``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_RETRY_BACKOFF_S", "RocketMQOptions"]

# RocketMQ's message delay levels from the second retry on (1s 5s 10s 30s 1m 2m ... 2h).
DEFAULT_RETRY_BACKOFF_S: tuple[int, ...] = (
    1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200,
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class RocketMQOptions:
    # Topics created on first use get RocketMQ's default of 8 read/write queues.
    default_queue_count: int = 8
    # The client checks bodies against this (Settings.publishing.max_body_size) too.
    max_body_bytes: int = 4 << 20
    # Delivery timestamps further ahead are ILLEGAL_DELIVERY_TIME (Apache's timer
    # store default, timerMaxDelaySec, is 3 days).
    max_delay_ms: int = 3 * 24 * 3600 * 1000
    # ReceiveMessage: Apache's proxy refuses invisible durations outside [10 s, 12 h]
    # for simple consumers; push consumers (auto_renew) get the default.
    min_invisible_ms: int = 10_000
    max_invisible_ms: int = 12 * 3600 * 1000
    default_invisible_ms: int = 60_000
    # Push consumers' messages stay invisible while the client holds them, renewed for
    # at most this long (see renewal.py).
    max_renew_ms: int = 3 * 3600 * 1000
    long_polling_ms: int = 20_000
    max_long_polling_ms: int = 30_000
    max_batch_size: int = 32
    # Transaction check-back: halves undecided for ``transaction_timeout_ms`` are
    # checked with their producers every ``transaction_check_interval_ms``, at most
    # ``transaction_max_checks`` times, then rolled back (Apache: 15 checks).
    transaction_check_interval_ms: int = 30_000
    transaction_timeout_ms: int = 6_000
    transaction_max_checks: int = 15
    # Push consumers' retry backoff (the Settings' customized backoff).
    retry_backoff_s: tuple[int, ...] = DEFAULT_RETRY_BACKOFF_S
    # Producers' send attempts (the Settings' exponential backoff).
    producer_max_attempts: int = 3
    # How far a request's signed x-mq-date-time may be from the server's clock. The
    # Python client stamps its local time with a "Z", so the window spans every time
    # zone (UTC-12 .. UTC+14) plus 15 minutes of clock drift; with clients on UTC
    # (node, Java, Go) it may be narrowed to the drift alone.
    signature_behind_ms: int = (12 * 3600 + 15 * 60) * 1000
    signature_ahead_ms: int = (14 * 3600 + 15 * 60) * 1000
