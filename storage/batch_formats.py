"""Expanders of producer batch formats, so a batch can be stored once, as produced.

A protocol whose batches other protocols must read one message at a time (Kafka's
record batches) registers a pure function from the raw bytes to the messages; the
engine then stores only ``raw`` and expands it on a message-by-message read. The
function must be deterministic and must return ``BatchEntry.count`` messages.
"""

from __future__ import annotations

from collections.abc import Callable

from polymq.storage.errors import InvalidArgument
from polymq.storage.model import Message

__all__ = ["Expander", "expand", "is_registered", "register"]

Expander = Callable[[bytes], tuple[Message, ...]]

_EXPANDERS: dict[str, Expander] = {}


def register(format_name: str, expander: Expander) -> None:
    """Register (or replace) the expander of ``format_name``."""
    _EXPANDERS[format_name] = expander


def is_registered(format_name: str) -> bool:
    return format_name in _EXPANDERS


def expand(format_name: str, raw: bytes) -> tuple[Message, ...]:
    expander = _EXPANDERS.get(format_name)
    if expander is None:
        raise InvalidArgument(f"no expander is registered for batch format {format_name!r}")
    return expander(raw)
