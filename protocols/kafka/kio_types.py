"""What the codec, the request checks (bounds.py) and the response writer share about
kio: how it marks a nullable field (``X | None``) and how it writes an unsigned varint."""

from __future__ import annotations

import types
import typing
from typing import Any

__all__ = ["is_nullable", "strip_none", "uvarint_bytes"]


def is_nullable(tp: Any) -> bool:
    """Whether ``tp`` is a union with ``None`` (a nullable kio field)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(tp)
    )


def strip_none(tp: Any) -> Any:
    """``X`` of ``X | None``; ``tp`` itself when it is not nullable. kio never unions two
    types, so a union of more is refused rather than guessed at."""
    if not is_nullable(tp):
        return tp
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(inner) != 1:
        raise TypeError(f"a union of several types: {tp!r}")
    return inner[0]


def uvarint_bytes(value: int) -> bytes:
    """An unsigned varint (compact lengths, tag numbers), as kio writes it."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
