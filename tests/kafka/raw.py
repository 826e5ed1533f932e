"""A raw Kafka client over a plain socket, built on kio: for requests no client library
sends on purpose (bad bytes, unknown versions, corrupt batches)."""

from __future__ import annotations

import datetime
import io
import socket
import struct
import time
import types
import typing
import uuid
from dataclasses import fields, is_dataclass
from typing import Any

from crc32c import crc32c
from kio.index import load_entity_schema
from kio.schema.errors import ErrorCode
from kio.schema.index import api_key_map
from kio.serial import entity_reader, entity_writer
from kio.static.constants import EntityType

from polymq.protocols.kafka.codec import build, request_class
from polymq.protocols.kafka.records import HEADER_SIZE, KafkaRecord, encode_batch

__all__ = [
    "RawKafka",
    "batch_with_body",
    "encode_request",
    "sample_request",
    "seconds_until_closed",
]


class RawKafka:
    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self._correlation = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawKafka:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, api_key: int, version: int, body: dict[str, Any]) -> bytes:
        """A request frame, size prefix included."""
        self._correlation += 1
        data = encode_request(api_key, version, body, self._correlation)
        return struct.pack(">i", len(data)) + data

    def read_frame(self) -> bytes | None:
        """One response frame's bytes after the size, or None if the server closed."""
        prefix = self._read(4)
        if prefix is None:
            return None
        (size,) = struct.unpack(">i", prefix)
        return self._read(size)

    def _read(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def request(self, api_key: int, version: int, body: dict[str, Any]) -> Any:
        self.send_bytes(self.frame(api_key, version, body))
        return self.response(api_key, version)

    def response(self, api_key: int, version: int) -> Any:
        data = self.read_frame()
        assert data is not None, "the server closed the connection"
        response_cls: Any = load_entity_schema(api_key_map[api_key], version, EntityType.response)
        offset = 4
        if response_cls.__flexible__ and api_key != 18:
            offset += 1
        body, _ = entity_reader(response_cls)(data, offset)
        return body

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def batch_with_body(codec: int, body: bytes, count: int) -> bytes:
    """A record batch with a valid CRC around any ``body``, claiming ``count`` records
    compressed with ``codec``: for records that are bad behind a good checksum."""
    one = [KafkaRecord(offset_delta=0, timestamp_ms=1, key=None, value=b"x")]
    head = bytearray(encode_batch(0, one)[:HEADER_SIZE])
    struct.pack_into(">h", head, 21, codec)
    struct.pack_into(">i", head, 23, count - 1)
    struct.pack_into(">i", head, 57, count)
    out = bytearray(bytes(head) + body)
    struct.pack_into(">i", out, 8, len(out) - 12)
    struct.pack_into(">I", out, 17, crc32c(bytes(out[21:])))
    return bytes(out)


def encode_request(
    api_key: int,
    version: int,
    body: dict[str, Any],
    correlation_id: int = 1,
    client_id: str = "raw",
) -> bytes:
    """A request frame without its size: header and ``body``."""
    name = api_key_map[api_key]
    request_cls: Any = load_entity_schema(name, version, EntityType.request)
    header_cls = request_cls.__header_schema__
    header = build(
        header_cls,
        {
            "request_api_key": api_key,
            "request_api_version": version,
            "correlation_id": correlation_id,
            "client_id": client_id,
        },
    )
    buffer = io.BytesIO()
    entity_writer(header_cls)(buffer, header)
    entity_writer(request_cls)(buffer, build(request_cls, body))
    return buffer.getvalue()


def sample_request(api_key: int, version: int, items: int = 2) -> bytes:
    """A request frame (without its size) of ``api_key`` v``version`` with every field
    set, tagged ones included, and ``items`` entries in every array: real frames for
    mutation searches, covering every schema without writing each one by hand."""
    body = _sample_entity(request_class(api_key, version), items)
    return encode_request(api_key, version, body, correlation_id=3, client_id="fz")


def _sample_entity(cls: Any, items: int) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {
        f.name: _sample(hints[f.name], f.metadata.get("kafka_type"), items) for f in fields(cls)
    }


def _sample(tp: Any, kind: str | None, items: int) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is tuple:
        return [_sample(typing.get_args(tp)[0], kind, items) for _ in range(items)]
    if is_dataclass(tp):
        return _sample_entity(tp, items)
    if kind == "records":
        return encode_batch(0, [KafkaRecord(offset_delta=0, timestamp_ms=1, key=b"k", value=b"v")])
    samples: list[tuple[type[Any], Any]] = [
        (ErrorCode, ErrorCode.none),
        (bool, True),
        (int, 1),
        (float, 1.5),
        (str, "ab"),
        (bytes, b"xy"),
        (datetime.timedelta, 5),
        (uuid.UUID, uuid.UUID(int=7)),
    ]
    for base, value in samples:
        if isinstance(tp, type) and issubclass(tp, base):
            return tp(value) if base is int else value
    raise TypeError(f"no sample for {tp!r}")


def seconds_until_closed(sock: socket.socket, give_up: float) -> float | None:
    """Seconds until the server closes ``sock`` (reading and dropping what it sends),
    None if it does not within ``give_up``."""
    started = time.monotonic()
    sock.settimeout(give_up)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return time.monotonic() - started
