"""The MNS API's side of the account quotas (gateway.quotas, docs/quotas.md).

HTTP has no way to slow a client down but to refuse: a request arriving while its
account owes time on the rates it would use (requests; produce for a send or publish,
consume for a receive) is answered as MNS answers its own flow limiter, ``429
TooManyRequests`` with the MNS error body, plus ``Retry-After``. A request that is
let in is charged afterwards (its body as produced bytes, a receive's answer as
consumed bytes), so the one that crosses the limit is served and the next waits.
"""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import Response

from polymq.gateway.quotas import AccountQuota, Kind
from polymq.protocols.mns.errors import MnsError

__all__ = ["admit", "charge_answer", "too_many_requests"]

PROTOCOL = "http"
_QUOTA_KEY = "polymq.quota"  # the admitted request's account quota, in its ASGI scope


def too_many_requests(message: str, retry_after_ms: int) -> MnsError:
    """MNS's throttling error (its "Throttling policy": 429 TooManyRequests)."""
    error = MnsError("TooManyRequests", message, 429)
    error.headers["retry-after"] = str(max(1, math.ceil(retry_after_ms / 1000)))
    return error


def _direction(request: Request) -> Kind | None:
    # The scope's path, not ``request.url``: building the whole URL cost more than
    # the rest of the quota check on every request.
    if not request.scope["path"].endswith("/messages"):
        return None
    if request.method == "POST":
        return "produce"
    if request.method == "GET":
        return "consume"
    return None


def admit(quota: AccountQuota, request: Request, body_bytes: int) -> None:
    """Refuse (raise 429) a request whose account owes time, else charge it."""
    direction = _direction(request)
    kinds: tuple[Kind, ...] = ("requests",) if direction is None else ("requests", direction)
    owed = quota.wait_ms(*kinds)
    if owed:
        quota.throttled(PROTOCOL, owed)
        raise too_many_requests(
            "The request is denied by the account's quota for too many requests.", owed
        )
    if direction == "produce":
        quota.produced(PROTOCOL, body_bytes, requests=1)
    else:
        quota.requested(PROTOCOL)
        if direction == "consume":
            request.scope[_QUOTA_KEY] = quota


def charge_answer(request: Request, response: Response) -> None:
    """Charge a receive's answer to the consume rate of the account it was for."""
    quota: AccountQuota | None = request.scope.get(_QUOTA_KEY)
    if quota is not None and response.status_code < 300:
        quota.consumed(PROTOCOL, len(getattr(response, "body", b"")))
