"""Raw MNS requests signed by the aliyun-mns-sdk's own signer, for what the SDK cannot
send (deduplication ids, dead-letter policies, malformed bodies, JSON)."""

from __future__ import annotations

import base64
import hashlib
import time

import httpx
from mns.auth import StaticCredentialsProvider
from mns.mns_client import MNSClient

from tests.mns.harness import ACCESS_KEY, SECRET_KEY


def sign_headers(
    method: str,
    resource: str,
    body: bytes = b"",
    *,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
    content_type: str = "text/xml;charset=UTF-8",
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    headers: dict[str, str] = {
        "x-mns-version": "2015-06-06",
        "date": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()),
        **(extra or {}),
    }
    if body:
        digest = hashlib.md5(body).hexdigest().encode()
        headers["content-md5"] = base64.b64encode(digest).decode()
        headers["content-type"] = content_type
    client = MNSClient("http://unused", ACCESS_KEY, SECRET_KEY)
    credential = StaticCredentialsProvider(access_key, secret_key, "").get_credentials()
    headers["Authorization"] = client.get_signature(method, headers, resource, credential)
    return headers


def request(
    base: str,
    method: str,
    resource: str,
    body: bytes = b"",
    **kwargs: object,
) -> httpx.Response:
    headers = sign_headers(method, resource, body, **kwargs)  # type: ignore[arg-type]
    return httpx.request(method, base + resource, content=body, headers=headers, timeout=30)
