"""Where each protocol's frames and length fields are in a recorded stream, so that
mutations can hit framing on purpose (a length claiming 4 GiB, a frame repeated 200
times) instead of hoping a random bit lands on it. Pure functions over bytes; a
stream that stops parsing just has fewer known frames."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["FRAMERS", "Frame", "frames"]

LengthKind = Literal["be", "varint", "ws7", "text"]

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass(frozen=True, slots=True)
class Frame:
    """``data[start:end]`` is one frame; its length field (if any) is
    ``data[length_at:length_at + length_size]``, encoded as ``kind``."""

    start: int
    end: int
    length_at: int = -1
    length_size: int = 0
    kind: LengthKind = "be"

    @property
    def has_length(self) -> bool:
        return self.length_size > 0


def _kafka(data: bytes) -> list[Frame]:
    out, pos = [], 0
    while pos + 4 <= len(data):
        size = int.from_bytes(data[pos : pos + 4], "big")
        end = pos + 4 + size
        if size <= 0 or end > len(data):
            break
        out.append(Frame(pos, end, pos, 4))
        pos = end
    return out


def _amqp(data: bytes) -> list[Frame]:
    out, pos = [], 0
    if data.startswith(b"AMQP"):
        out.append(Frame(0, 8))
        pos = 8
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos + 3 : pos + 7], "big")
        end = pos + 7 + size + 1
        if end > len(data) or data[end - 1] != 0xCE:
            break
        out.append(Frame(pos, end, pos + 3, 4))
        pos = end
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    """(value, bytes used) of the MQTT variable byte integer at ``pos``."""
    value, shift = 0, 0
    for i in range(4):
        if pos + i >= len(data):
            return None
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return None


def _mqtt(data: bytes, pos: int = 0) -> list[Frame]:
    out = []
    while pos + 2 <= len(data):
        parsed = _varint(data, pos + 1)
        if parsed is None:
            break
        value, used = parsed
        end = pos + 1 + used + value
        if end > len(data):
            break
        out.append(Frame(pos, end, pos + 1, used, "varint"))
        pos = end
    return out


def _http2(data: bytes) -> list[Frame]:
    out, pos = [], 0
    if data.startswith(_H2_PREFACE):
        out.append(Frame(0, len(_H2_PREFACE)))
        pos = len(_H2_PREFACE)
    while pos + 9 <= len(data):
        end = pos + 9 + int.from_bytes(data[pos : pos + 3], "big")
        if end > len(data):
            break
        out.append(Frame(pos, end, pos, 3))
        pos = end
    return out


def _http_head(data: bytes, pos: int) -> tuple[int, int, int] | None:
    """(end of headers, Content-Length digits start, their size) of the request at
    ``pos``; digits size 0 when it has none."""
    head_end = data.find(b"\r\n\r\n", pos)
    if head_end < 0:
        return None
    head_end += 4
    lower = data[pos:head_end].lower()
    at = lower.find(b"\r\ncontent-length:")
    if at < 0:
        return head_end, -1, 0
    digits = pos + at + len(b"\r\ncontent-length:")
    while data[digits : digits + 1] == b" ":
        digits += 1
    size = 0
    while data[digits + size : digits + size + 1].isdigit():
        size += 1
    return head_end, digits, size


def _http(data: bytes) -> list[Frame]:
    out, pos = [], 0
    while pos < len(data):
        head = _http_head(data, pos)
        if head is None:
            break
        head_end, digits, size = head
        body = int(data[digits : digits + size]) if size else 0
        end = min(len(data), head_end + body)
        out.append(Frame(pos, end, digits, size, "text") if size else Frame(pos, end))
        pos = end
    return out


def _websocket(data: bytes) -> list[Frame]:
    head = _http_head(data, 0)
    if head is None:
        return []
    out, pos = [Frame(0, head[0])], head[0]
    while pos + 2 <= len(data):
        short = data[pos + 1] & 0x7F
        masked = 4 if data[pos + 1] & 0x80 else 0
        if short == 126:
            length, ext = int.from_bytes(data[pos + 2 : pos + 4], "big"), 2
        elif short == 127:
            length, ext = int.from_bytes(data[pos + 2 : pos + 10], "big"), 8
        else:
            length, ext = short, 0
        end = pos + 2 + ext + masked + length
        if end > len(data):
            break
        if ext:
            out.append(Frame(pos, end, pos + 2, ext))
        else:
            out.append(Frame(pos, end, pos + 1, 1, "ws7"))
        pos = end
    return out


FRAMERS: Mapping[str, Callable[[bytes], list[Frame]]] = {
    "kafka": _kafka,
    "amqp": _amqp,
    "mqtt": _mqtt,
    "mqtt_ws": _websocket,
    "rocketmq": _http2,
    "http": _http,
}


def frames(protocol: str, data: bytes) -> list[Frame]:
    return FRAMERS[protocol](data)
