"""MNS request signatures. Pure: strings in, strings out.

The string to sign (MNS API reference, "Signature"; the aliyun-mns-sdk's
``MNSClient.get_signature`` builds the same)::

    VERB \\n Content-MD5 \\n Content-Type \\n Date \\n
    CanonicalizedMNSHeaders CanonicalizedResource

where the MNS headers are every ``x-mns-*`` header, lower-cased, sorted, each written
``name:value\\n``, and the resource is the request path with its query string exactly
as sent. The signature is base64(HMAC-SHA1(secret, string)), sent as
``Authorization: MNS AccessKeyId:Signature``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable

__all__ = ["parse_authorization", "sign", "string_to_sign", "verify"]


def string_to_sign(
    *,
    method: str,
    resource: str,
    headers: Iterable[tuple[str, str]],
) -> str:
    """``headers`` are (name, value) pairs; names are compared case-insensitively."""
    lowered = [(name.lower(), value) for name, value in headers]
    plain = dict(lowered)
    mns = "".join(
        f"{name}:{value}\n" for name, value in sorted(lowered) if name.startswith("x-mns-")
    )
    return (
        f"{method.upper()}\n{plain.get('content-md5', '')}\n{plain.get('content-type', '')}\n"
        f"{plain.get('date', '')}\n{mns}{resource}"
    )


def sign(secret_key: str, text: str) -> str:
    digest = hmac.new(secret_key.encode(), text.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


def verify(secret_key: str, text: str, signature: str) -> bool:
    """Constant-time, so the answer's timing does not leak the expected signature."""
    return hmac.compare_digest(sign(secret_key, text).encode(), signature.encode())


def parse_authorization(value: str) -> tuple[str, str] | None:
    """``MNS AccessKeyId:Signature`` as (access key id, signature); ``None`` if the
    header has another form."""
    scheme, _, credentials = value.strip().partition(" ")
    access_key, sep, signature = credentials.strip().rpartition(":")
    if scheme != "MNS" or not sep or not access_key or not signature:
        return None
    return access_key, signature
