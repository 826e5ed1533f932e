"""Validation of resource names (namespaces, topics, groups, metadata kinds and keys).

Names never reach the file system (files are named by numeric ids), so the rule is the
union of what the protocols allow: RabbitMQ takes any UTF-8 queue name up to 255
bytes, an MQTT topic level may hold spaces and non-ASCII text. Only empty names,
over-long names and control characters are refused.
"""

from __future__ import annotations

from polymq.storage.errors import InvalidName

__all__ = ["MAX_NAME_BYTES", "check_name"]

MAX_NAME_BYTES = 255


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if valid, else raise :class:`InvalidName` saying why."""
    if not isinstance(name, str):
        raise InvalidName(f"{kind} name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidName(f"{kind} name must not be empty")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidName(f"{kind} name is longer than {MAX_NAME_BYTES} bytes: {name[:40]!r}...")
    for char in name:
        if char < " " or char == "\x7f" or "\ud800" <= char <= "\udfff":
            raise InvalidName(f"{kind} name {name!r} contains a control or surrogate character")
    return name
