"""gRPC over HTTP/2 (grpc's PROTOCOL-HTTP2.md): length-prefixed messages, the
``grpc-timeout`` header, call metadata and the status trailers. Pure: no sockets, no
asyncio."""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Iterable
from typing import Final

from polymq.protocols.grpc_server.frames import headers_block

__all__ = [
    "MESSAGE_PREFIX",
    "RESPONSE_HEADERS",
    "MessageTooLarge",
    "Metadata",
    "StatusCode",
    "cut_messages",
    "message_bytes",
    "metadata",
    "parse_timeout",
    "status_block",
]

MESSAGE_PREFIX: Final = 5
_PREFIX = struct.Struct(">BI")
# The answer's headers: :status 200 (static table index 8) and the content type.
RESPONSE_HEADERS: Final = b"\x88" + headers_block(((b"content-type", b"application/grpc"),))
_TRAILERS_ONLY_HEAD: Final = RESPONSE_HEADERS

# Headers that are the transport's, not the call's metadata (grpc leaves them out too).
_TRANSPORT_HEADERS: Final = frozenset(
    (
        b"content-type",
        b"te",
        b"grpc-timeout",
        b"grpc-encoding",
        b"grpc-accept-encoding",
        b"user-agent",
    )
)
_TIMEOUT_UNITS: Final = {
    ord("H"): 3600.0,
    ord("M"): 60.0,
    ord("S"): 1.0,
    ord("m"): 1e-3,
    ord("u"): 1e-6,
    ord("n"): 1e-9,
}

Metadata = tuple[tuple[str, str | bytes], ...]


class StatusCode:
    OK: Final = 0
    CANCELLED: Final = 1
    UNKNOWN: Final = 2
    INVALID_ARGUMENT: Final = 3
    DEADLINE_EXCEEDED: Final = 4
    RESOURCE_EXHAUSTED: Final = 8
    UNIMPLEMENTED: Final = 12
    INTERNAL: Final = 13
    UNAVAILABLE: Final = 14


class MessageTooLarge(Exception):
    """A message's prefix announces more than the server takes."""


def message_bytes(payload: bytes) -> bytes:
    """``payload`` as one uncompressed gRPC message."""
    return _PREFIX.pack(0, len(payload)) + payload


def cut_messages(buffer: bytearray, max_size: int) -> tuple[list[bytes], bool]:
    """The whole messages at the start of ``buffer``, removed from it, and whether one
    of them was compressed (which this server does not accept: it offers no
    ``grpc-accept-encoding``). A prefix announcing more than ``max_size`` raises
    :class:`MessageTooLarge` before its bytes are awaited."""
    messages: list[bytes] = []
    compressed = False
    at, end = 0, len(buffer)
    while end - at >= MESSAGE_PREFIX:
        flag, length = _PREFIX.unpack_from(buffer, at)
        if length > max_size:
            raise MessageTooLarge(f"a message of {length} bytes; at most {max_size}")
        if end - at - MESSAGE_PREFIX < length:
            break
        compressed |= bool(flag)
        messages.append(bytes(buffer[at + MESSAGE_PREFIX : at + MESSAGE_PREFIX + length]))
        at += MESSAGE_PREFIX + length
    if at:
        del buffer[:at]
    return messages, compressed


def parse_timeout(value: bytes) -> float | None:
    """``grpc-timeout`` in seconds (at most 8 digits and a unit), or None if it is not
    one."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1])
    return int(value[:-1]) * unit if unit is not None else None


def metadata(headers: Iterable[tuple[bytes, bytes]]) -> Metadata:
    """A call's metadata as grpc hands it to a handler: keys as text, ``-bin`` values
    base64-decoded to bytes, the others as text (bytes that are not UTF-8 read as
    Latin-1, as grpc does)."""
    out: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name[:1] == b":" or name in _TRANSPORT_HEADERS:
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            try:
                out.append((key, base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)))
            except (binascii.Error, ValueError):
                continue
            continue
        try:
            out.append((key, value.decode("utf-8")))
        except UnicodeDecodeError:
            out.append((key, value.decode("latin-1")))
    return tuple(out)


def _percent_encoded(message: str) -> bytes:
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def status_block(code: int, message: str = "", *, trailers_only: bool = False) -> bytes:
    """The trailers ending a call (``grpc-status``, ``grpc-message``); a call refused
    before any answer is "Trailers-Only": the response headers and these in one block."""
    fields = [(b"grpc-status", str(code).encode())]
    if message:
        fields.append((b"grpc-message", _percent_encoded(message)))
    block = headers_block(fields)
    return _TRAILERS_ONLY_HEAD + block if trailers_only else block
