"""Reading an MNS request and writing its answer: the signature (through
:class:`RequestAuth`), the body (bounded, Content-MD5 checked, decoded as XML or JSON),
the query; and the reply as MNS XML, or JSON when the client sends
``Accept: application/json``."""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from polymq.gateway.connections import AccountConnectionLimit, ConnectionRegistry
from polymq.gateway.fairness import slices
from polymq.gateway.processor import Caller
from polymq.gateway.quotas import Quotas
from polymq.protocols.mns import codec
from polymq.protocols.mns.attributes import parse_int
from polymq.protocols.mns.auth import RequestAuth
from polymq.protocols.mns.errors import MnsError
from polymq.protocols.mns.quota import admit, too_many_requests

__all__ = [
    "API_VERSION",
    "BATCH_MAX",
    "CONNECTION_ID",
    "PROTOCOL",
    "MnsCall",
    "PeerGone",
    "RequestReader",
    "base_headers",
    "error_response",
    "message_documents",
    "wants_json",
]

PROTOCOL = "http"
# The ASGI scope key under which the listener puts the connection's registry id.
CONNECTION_ID = "polymq.connection_id"
API_VERSION = "2015-06-06"
BATCH_MAX = 16
_LIST_MAX = 1000
# XML is parsed in slices this large, handing the loop back between them: a slice
# of the smallest elements takes a few milliseconds.
_PARSE_SLICE = 8 << 10


class PeerGone(Exception):
    """The client went away before its request was read whole: nothing to answer."""


def wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


# Request ids: unique per process start (a random prefix) and per request (a counter),
# 24 hex digits as MNS's; cheaper than a uuid4 per request.
_REQUEST_ID_KEY = "polymq.mns_request_id"
_REQUEST_ID_PREFIX = os.urandom(6).hex().upper()
_request_numbers = itertools.count(1)


def request_id(request: Request) -> str:
    scope = request.scope
    rid: str | None = scope.get(_REQUEST_ID_KEY)
    if rid is None:
        rid = scope[_REQUEST_ID_KEY] = f"{_REQUEST_ID_PREFIX}{next(_request_numbers):012X}"
    return rid


def base_headers(request: Request) -> dict[str, str]:
    return {"x-mns-request-id": request_id(request), "x-mns-version": API_VERSION}


def error_response(request: Request, error: MnsError) -> Response:
    """An MNS ``<Error>`` document (or its JSON form) with the error's status."""
    as_json = wants_json(request)
    body = codec.encode(
        "Error",
        {
            "Code": error.code,
            "Message": error.message,
            "RequestId": request_id(request),
            "HostId": f"{request.url.scheme}://{request.url.netloc}",
        },
        as_json=as_json,
    )
    return Response(
        body,
        status_code=error.status,
        media_type="application/json" if as_json else "text/xml;charset=utf-8",
        headers={**base_headers(request), **error.headers},
    )


@dataclass(frozen=True, slots=True)
class MnsCall:
    """One authenticated request: who, what it sent, how to answer."""

    request: Request
    caller: Caller
    root: str | None
    document: Any
    query: Mapping[str, str]

    def reply(
        self,
        status: int,
        root: str | None = None,
        value: Mapping[str, Any] | Sequence[Any] | None = None,
        *,
        location: str | None = None,
    ) -> Response:
        headers = base_headers(self.request)
        if location is not None:
            headers["location"] = location
        if root is None or value is None:
            return Response(status_code=status, headers=headers)
        as_json = wants_json(self.request)
        return Response(
            codec.encode(root, value, as_json=as_json),
            status_code=status,
            media_type="application/json" if as_json else "text/xml;charset=utf-8",
            headers=headers,
        )

    async def create_or_override(
        self,
        create: Callable[..., Awaitable[bool]],
        override: Callable[..., Awaitable[None]],
        *names: str,
        location: str,
    ) -> Response:
        """The PUT of a queue, topic or subscription: ``create(caller, *names,
        document)``, 201 when it made it and 204 when it stood already with the same
        attributes; with ``?metaoverride=true``, ``override`` sets the attributes (204)."""
        if self.query.get("metaoverride") == "true":
            await override(self.caller, *names, self.document)
            return self.reply(204)
        created = await create(self.caller, *names, self.document)
        return self.reply(201 if created else 204, location=location)

    def url(self, *parts: str) -> str:
        base = f"{self.request.url.scheme}://{self.request.url.netloc}"
        return base + "/" + "/".join(parts)

    def int_query(self, name: str, low: int, high: int) -> int | None:
        value = self.query.get(name.lower())
        return None if value is None else parse_int(name, value, low, high)

    def option(self, name: str) -> str | None:
        """A list option: the SDK sends ``x-mns-<name>`` headers; curl users may use
        the query string."""
        value = self.request.headers.get(f"x-mns-{name}")
        return value if value is not None else self.query.get(name.replace("-", ""))

    def page(self, names: list[str]) -> tuple[list[str], str | None]:
        prefix = self.option("prefix") or ""
        marker = self.option("marker") or ""
        raw_number = self.option("ret-number")
        number = _LIST_MAX if raw_number is None else parse_int("RetNumber", raw_number, 1, 1000)
        matching = [n for n in names if n.startswith(prefix) and n >= marker]
        page = matching[:number]
        return page, (matching[number] if len(matching) > number else None)


class RequestReader:
    """Turns an HTTP request into an authenticated :class:`MnsCall`."""

    def __init__(
        self,
        auth: RequestAuth,
        *,
        max_message_bytes: int,
        connections: ConnectionRegistry | None = None,
        max_depth: int = codec.MAX_DEPTH,
        max_items: int = codec.MAX_ITEMS,
        quotas: Quotas | None = None,
    ) -> None:
        self._auth = auth
        self._connections = connections
        self._quotas = quotas  # per-account rates (protocols.mns.quota)
        self._max_depth = max_depth
        self._max_items = max_items
        # A batch's messages total at most max_message_bytes (MNS: 64 KB), and escaping
        # makes a character at most 6 (``&quot;``, ``\u0001``); more is refused unread.
        self._max_body_bytes = max_message_bytes * 6 + 64 * 1024

    @property
    def max_body_bytes(self) -> int:
        return self._max_body_bytes

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise MnsError.body_too_long(self._max_body_bytes)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self._max_body_bytes:
                    raise MnsError.body_too_long(self._max_body_bytes)
                chunks.append(chunk)
        except ClientDisconnect:
            raise PeerGone from None
        return b"".join(chunks)

    async def _decode(self, body: bytes, *, json_body: bool) -> tuple[str | None, Any]:
        if json_body or len(body) <= _PARSE_SLICE or not body.strip():
            return codec.decode(
                body, json_body=json_body, max_depth=self._max_depth, max_items=self._max_items
            )
        reader = codec.XmlReader(self._max_depth, self._max_items)
        view = memoryview(body)
        async for part in slices(len(body), _PARSE_SLICE):
            reader.feed(bytes(view[part]))
        return reader.close()

    def _authenticate(self, request: Request) -> Caller:
        principal = self._auth.principal(
            method=request.method,
            raw_path=(request.scope.get("raw_path") or request.scope["path"].encode()).decode(),
            query=request.scope.get("query_string", b"").decode(),
            headers=request.headers.items(),
        )
        namespace = principal.default_namespace
        connection_id: int | None = request.scope.get(CONNECTION_ID)
        if connection_id is not None and self._connections is not None:
            # A keep-alive connection belongs to whoever signed its requests last.
            known = self._connections.get(connection_id)
            if known is not None and (known.principal, known.namespace) != (principal, namespace):
                try:
                    self._connections.identify(
                        connection_id, principal=principal, namespace=namespace
                    )
                except AccountConnectionLimit as e:  # the account's quota
                    raise too_many_requests(f"Connection refused: {e}.", 1000) from e
        return Caller(
            principal=principal,
            namespace=namespace,
            protocol=PROTOCOL,
            connection_id=connection_id,
        )

    async def read(self, request: Request) -> MnsCall:
        caller = self._authenticate(request)
        body = await self._read_body(request)
        if self._quotas is not None:
            admit(self._quotas.of(caller.principal), request, len(body))
        _check_digest(request.headers.get("content-md5"), body)
        json_body = "json" in request.headers.get("content-type", "")
        try:
            root, document = await self._decode(body, json_body=json_body)
        except codec.MalformedDocument as e:
            raise MnsError.malformed(str(e)) from None
        return MnsCall(request, caller, root, document, _query(request.scope))


def _query(scope: Mapping[str, Any]) -> dict[str, str]:
    """The query's parameters by lower-cased name, the last value of a repeated one:
    what ``request.query_params`` gives (starlette parses the same way), without the
    multidict it builds and copies, twice the cost of the parsing itself."""
    raw: bytes = scope.get("query_string", b"")
    if not raw:
        return {}
    named = dict(urllib.parse.parse_qsl(raw.decode("latin-1"), keep_blank_values=True))
    return {k.lower(): v for k, v in named.items()}


def _check_digest(content_md5: str | None, body: bytes) -> None:
    """Content-MD5, when sent, is base64 of the body's MD5: of its hex digest as the
    aliyun-mns-sdk sends it, or of the raw digest (RFC 1864)."""
    if not content_md5 or not body:
        return
    digest = hashlib.md5(body, usedforsecurity=False)
    accepted = (
        base64.b64encode(digest.hexdigest().encode()).decode(),
        base64.b64encode(digest.digest()).decode(),
    )
    if content_md5.strip() not in accepted:
        raise MnsError("InvalidDigest", "The Content-MD5 you specified is invalid.")


def message_documents(root: str | None, document: Any) -> tuple[list[Any], bool]:
    """The message documents of a send, and whether it was a batch."""
    if root == "Messages" or isinstance(document, list):
        items = document
    elif root is None and isinstance(document, Mapping) and "Messages" in document:
        items = document["Messages"]
    elif root in (None, "Message"):
        return [document], False
    else:
        raise MnsError.invalid_argument(f"expected <Message> or <Messages>, got <{root}>.")
    if not isinstance(items, list) or not all(isinstance(item, Mapping) for item in items):
        raise MnsError.invalid_argument("Messages must be a list of <Message> documents.")
    return items, True
