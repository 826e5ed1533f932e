"""Kafka request frames (size prefix stripped) through ``decode_request``.

Documented errors: :class:`BadRequest` (the connection is closed) and
:class:`UnsupportedVersion` (answered with error 35). kio's decoder is native code: a
bad declared array length there can abort the process, which is why every target runs
in a subprocess of its own.
"""

from __future__ import annotations

import contextlib

from polymq.protocols.kafka.codec import BadRequest, UnsupportedVersion, decode_request


def one_input(data: bytes) -> None:
    with contextlib.suppress(BadRequest, UnsupportedVersion):
        decode_request(data)
