"""AMQP 0-9-1 frames after the protocol header: methods (with their field tables:
``arguments``, ``client_properties``...), content headers (with the ``headers``
table), bodies and heartbeats, through :class:`FrameReader` as the server reads them.

Documented errors: :class:`FrameError` and :class:`ProtocolHeaderError` (Connection.Close
501 / the protocol header and close).
"""

from __future__ import annotations

from polymq.protocols.amqp.codec import FrameError, FrameReader, ProtocolHeaderError

_FRAME_MAX = 131072


def one_input(data: bytes) -> None:
    reader = FrameReader(frame_max=_FRAME_MAX, hard_max=_FRAME_MAX, expect_header=False)
    reader.receive_data(data)
    try:
        while reader.next_frame() is not None:
            pass
    except (FrameError, ProtocolHeaderError):
        pass
