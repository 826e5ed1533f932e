"""A raw Kafka client over a plain socket, built on kio: for requests no client library
sends on purpose (bad bytes, unknown versions, corrupt batches)."""

from __future__ import annotations

import io
import socket
import struct
from typing import Any

from crc32c import crc32c
from kio.index import load_entity_schema
from kio.schema.index import api_key_map
from kio.serial import entity_reader, entity_writer
from kio.static.constants import EntityType

from protocols.kafka.codec import build
from protocols.kafka.records import HEADER_SIZE, KafkaRecord, encode_batch

__all__ = ["RawKafka", "batch_with_body"]


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
        name = api_key_map[api_key]
        request_cls: Any = load_entity_schema(name, version, EntityType.request)
        header_cls = request_cls.__header_schema__
        self._correlation += 1
        header = build(
            header_cls,
            {
                "request_api_key": api_key,
                "request_api_version": version,
                "correlation_id": self._correlation,
                "client_id": "raw",
            },
        )
        buffer = io.BytesIO()
        entity_writer(header_cls)(buffer, header)
        entity_writer(request_cls)(buffer, build(request_cls, body))
        data = buffer.getvalue()
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
