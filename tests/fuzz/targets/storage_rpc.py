"""Storage RPC frames (length-prefixed msgpack, the gateways-to-nodes wire) through
:class:`FrameDecoder`, fed in two pieces split where the first byte says, as they
arrive from a socket.

Documented error: :class:`CodecError` (that one connection is closed).
"""

from __future__ import annotations

from polymq.storage.rpc.codec import CodecError, FrameDecoder

_MAX_FRAME_BYTES = 1 << 20


def one_input(data: bytes) -> None:
    if not data:
        return
    split = 1 + data[0] % max(1, len(data))
    decoder = FrameDecoder(_MAX_FRAME_BYTES)
    try:
        decoder.feed(data[1:split])
        decoder.feed(data[split:])
    except CodecError:
        pass
