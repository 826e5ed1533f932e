"""Kafka record batches (message format v2), every compression, through the paths a
produced batch takes: the header check, the cheap record walk done before storing, and
the full expansion other protocols read it by.

The target rewrites the batch's length and CRC-32C to match the bytes before checking
them, as a hostile client computes them: otherwise almost every mutation would stop at
the CRC and the record parser behind it would never be reached.

Documented error: :class:`CorruptBatch`. ``expand_batch`` never fails by contract; it
runs on what storage holds, so only on batches ``check_records`` let through.
"""

from __future__ import annotations

import struct

from crc32c import crc32c

from polymq.protocols.kafka.records import (
    HEADER_SIZE,
    CorruptBatch,
    check_records,
    expand_batch,
    iter_records,
    parse_header,
)

_CRC_START = 21


def _sealed(data: bytes) -> bytes:
    if len(data) < HEADER_SIZE:
        return data
    batch = bytearray(data)
    struct.pack_into(">i", batch, 8, len(batch) - 12)
    struct.pack_into(">I", batch, 17, crc32c(bytes(batch[_CRC_START:])))
    return bytes(batch)


def one_input(data: bytes) -> None:
    batch = _sealed(data)
    try:
        parse_header(batch)
        check_records(batch)
    except CorruptBatch:
        return
    try:
        for _ in iter_records(batch):
            pass
    except CorruptBatch:
        pass
    expand_batch(batch)
