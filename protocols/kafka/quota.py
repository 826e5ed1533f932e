"""Kafka's quotas, as a Kafka broker applies them (KIP-13, KIP-219): the request is
served, its answer carries ``throttle_time_ms`` (never an error), and the connection is
then muted, not read, for that long; clients back off on their own meanwhile.

Produce requests are charged their size to the account's produce bucket, Fetch
responses theirs to the consume bucket (Kafka measures both so), and every request one
to the requests bucket; the longest throttle of the three is the answer's. Older
request versions, which predate KIP-219, are answered the same way: the mute alone
holds the client back. The buckets are the gateway's (gateway.quotas).
"""

from __future__ import annotations

from polymq.gateway.quotas import AccountQuota
from polymq.protocols.kafka._state import AuthState
from polymq.protocols.kafka.session import PROTOCOL, Session

__all__ = ["charge", "mute"]

PRODUCE = 0
FETCH = 1


def _quota(session: Session) -> AccountQuota | None:
    if session.state is not AuthState.AUTHENTICATED:
        return None  # SASL in progress: nobody to charge yet
    return session.services.quotas.of(session.caller.principal)


def charge(session: Session, api_key: int, request_bytes: int, response_bytes: int) -> int:
    """Charge one request and its bytes to the session's account; returns the throttle
    time in ms (also kept on the session, for :func:`mute`)."""
    quota = _quota(session)
    if quota is None:
        return 0
    if api_key == PRODUCE:
        owed = quota.produced(PROTOCOL, request_bytes, requests=1)
    else:
        owed = quota.requested(PROTOCOL)
        if api_key == FETCH:
            owed = max(owed, quota.consumed(PROTOCOL, response_bytes))
    if owed:  # answered with this throttle time, and muted for it
        quota.throttled(PROTOCOL, owed)
        session.throttle_ms = max(session.throttle_ms, owed)
    return owed


async def mute(session: Session) -> None:
    """Read nothing more from the connection until its throttle time is over."""
    owed, session.throttle_ms = session.throttle_ms, 0
    if owed:
        clock = session.processor.clock
        await clock.sleep_until(clock.now_ms() + owed)
