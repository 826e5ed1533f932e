"""RocketMQ 5 request signatures (pure: no I/O).

Every request carries gRPC metadata ``authorization: MQv2-HMAC-SHA1 Credential=<ak>,
SignedHeaders=x-mq-date-time, Signature=<hex>`` where the signature is
HMAC-SHA1(secret key, value of ``x-mq-date-time``), lower-case hex, as the official
clients compute it (rocketmq-clients ``Signature``). ``x-mq-namespace`` names the
resource namespace, ``x-mq-client-id`` the client.
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ALGORITHM",
    "RequestHeaders",
    "SignatureError",
    "check_date",
    "date_time_ms",
    "parse_authorization",
    "read_headers",
    "sign",
    "verify",
]

ALGORITHM = "MQv2-HMAC-SHA1"


class SignatureError(ValueError):
    """The authorization header is malformed or its signature does not match."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestHeaders:
    """What a request says about its sender, from its gRPC metadata."""

    access_key: str | None = None
    signature: str | None = None
    date_time: str | None = None
    namespace: str = ""
    client_id: str | None = None
    language: str | None = None


def parse_authorization(value: str) -> tuple[str, str]:
    """``(access key, signature)`` from an authorization header value."""
    algorithm, _, rest = value.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise SignatureError(f"unsupported signature algorithm {algorithm!r}")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, sep, field = part.strip().partition("=")
        if sep:
            fields[name] = field
    if "Credential" not in fields or "Signature" not in fields:
        raise SignatureError("authorization lacks Credential or Signature")
    return fields["Credential"], fields["Signature"]


_WANTED = frozenset(
    ("authorization", "x-mq-date-time", "x-mq-namespace", "x-mq-client-id", "x-mq-language")
)


def read_headers(metadata: Iterable[tuple[str, str | bytes]]) -> RequestHeaders:
    """The headers that say who sent a request (grpc hands metadata keys over in lower
    case, as HTTP/2 requires); every other key is skipped."""
    values: dict[str, str] = {}
    for key, value in metadata:
        if key in _WANTED:
            values[key] = value.decode() if isinstance(value, bytes) else value
    access_key = signature = None
    if values.get("authorization"):
        access_key, signature = parse_authorization(values["authorization"])
    return RequestHeaders(
        access_key=access_key or None,
        signature=signature,
        date_time=values.get("x-mq-date-time"),
        namespace=values.get("x-mq-namespace", ""),
        client_id=values.get("x-mq-client-id") or None,
        language=values.get("x-mq-language"),
    )


def sign(secret_key: str, date_time: str) -> str:
    return hmac.new(secret_key.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def verify(headers: RequestHeaders, secret_key: str) -> None:
    """Raise :class:`SignatureError` unless the request was signed with ``secret_key``."""
    if headers.signature is None or headers.date_time is None:
        raise SignatureError("request is not signed")
    expected = sign(secret_key, headers.date_time)
    if not hmac.compare_digest(expected.lower(), headers.signature.lower()):
        raise SignatureError("signature does not match")


def date_time_ms(date_time: str) -> int:
    """``20250101T000000Z`` (the clients' ``x-mq-date-time``) in epoch milliseconds."""
    if len(date_time) != 16 or date_time[8] != "T" or date_time[15] != "Z":
        raise SignatureError(f"x-mq-date-time {date_time!r} is not yyyyMMddTHHmmssZ")
    digits = date_time[:8] + date_time[9:15]
    if not digits.isascii() or not digits.isdigit():
        raise SignatureError(f"x-mq-date-time {date_time!r} is not yyyyMMddTHHmmssZ")
    fields = (
        int(digits[0:4]),
        int(digits[4:6]),
        int(digits[6:8]),
        int(digits[8:10]),
        int(digits[10:12]),
        int(digits[12:14]),
    )
    if not (1 <= fields[1] <= 12 and 1 <= fields[2] <= 31 and fields[3] < 24):
        raise SignatureError(f"x-mq-date-time {date_time!r} is not a valid time")
    return calendar.timegm((*fields, 0, 0, 0)) * 1000


def check_date(headers: RequestHeaders, now_ms: int, *, behind_ms: int, ahead_ms: int) -> None:
    """Raise :class:`SignatureError` unless the signed date is within
    ``[now - behind_ms, now + ahead_ms]``: a signature covers only the date, so the
    window is how long a captured header stays usable."""
    if headers.date_time is None:
        raise SignatureError("request is not signed")
    signed_ms = date_time_ms(headers.date_time)
    if not now_ms - behind_ms <= signed_ms <= now_ms + ahead_ms:
        raise SignatureError(
            f"x-mq-date-time {headers.date_time} is too far from the server's clock"
        )
