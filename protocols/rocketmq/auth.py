"""RocketMQ 5 request signatures (pure: no I/O).

Every request carries gRPC metadata ``authorization: MQv2-HMAC-SHA1 Credential=<ak>,
SignedHeaders=x-mq-date-time, Signature=<hex>`` where the signature is
HMAC-SHA1(secret key, value of ``x-mq-date-time``), lower-case hex, as the official
clients compute it (rocketmq-clients ``Signature``). ``x-mq-namespace`` names the
resource namespace, ``x-mq-client-id`` the client.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ALGORITHM",
    "RequestHeaders",
    "SignatureError",
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


def read_headers(metadata: Iterable[tuple[str, str | bytes]]) -> RequestHeaders:
    values: dict[str, str] = {}
    for key, value in metadata:
        values[key.lower()] = value.decode() if isinstance(value, bytes) else value
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
