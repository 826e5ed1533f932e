"""Message ids and receipt handles.

Message ids follow RocketMQ 5's layout so RocketMQ clients can show them unchanged:
``01`` + 6-byte node id + 2-byte process id + 4-byte seconds since 2021-01-01 UTC +
4-byte counter, 34 upper-case hex digits.

A receipt handle names one hand-out of one message to one group: topic id, queue,
offset and the hand-out's sequence number. It is opaque to clients; the engine checks
it against its pop state, so a forged or stale one is simply refused.
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
import struct
from pathlib import Path

from polymq.storage.errors import InvalidReceipt

__all__ = ["MessageIds", "Receipt", "decode_receipt", "encode_receipt", "load_node_id"]

_EPOCH_2021_MS = 1_609_459_200_000
_RECEIPT = struct.Struct("<BIIqq")
_RECEIPT_VERSION = 1


def load_node_id(data_dir: Path) -> bytes:
    """A random 6-byte id kept in ``node_id`` so ids stay distinct across nodes."""
    path = data_dir / "node_id"
    if path.exists():
        value = bytes.fromhex(path.read_text().strip())
        if len(value) == 6:
            return value
    value = secrets.token_bytes(6)
    path.write_text(value.hex())
    return value


class MessageIds:
    def __init__(self, node_id: bytes) -> None:
        self._prefix = "01" + node_id.hex().upper() + f"{os.getpid() & 0xFFFF:04X}"
        self._counter = secrets.randbits(32)

    def next(self, now_ms: int) -> str:
        self._counter = (self._counter + 1) & 0xFFFFFFFF
        seconds = max(0, (now_ms - _EPOCH_2021_MS) // 1000) & 0xFFFFFFFF
        return f"{self._prefix}{seconds:08X}{self._counter:08X}"


Receipt = tuple[int, int, int, int]  # topic id, queue id, offset, hand-out seq


def encode_receipt(topic_id: int, queue_id: int, offset: int, seq: int) -> str:
    raw = _RECEIPT.pack(_RECEIPT_VERSION, topic_id, queue_id, offset, seq)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_receipt(receipt: str) -> Receipt:
    try:
        raw = base64.urlsafe_b64decode(receipt + "=" * (-len(receipt) % 4))
        version, topic_id, queue_id, offset, seq = _RECEIPT.unpack(raw)
    except (binascii.Error, struct.error, ValueError, TypeError) as exc:
        raise InvalidReceipt(f"malformed receipt handle {receipt[:60]!r}") from exc
    if version != _RECEIPT_VERSION:
        raise InvalidReceipt(f"unknown receipt handle version {version}")
    return topic_id, queue_id, offset, seq
