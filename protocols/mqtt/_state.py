"""The MQTT connection's states and which packets each accepts, in one table
(v5 3.1: the first packet is CONNECT and only the first; 3.1.4: the server reads
nothing else before it).
"""

from __future__ import annotations

from enum import Enum

from polymq.protocols.mqtt import codec

__all__ = ["ConnectionState", "accepts"]


class ConnectionState(Enum):
    AWAIT_CONNECT = "await-connect"
    CONNECTED = "connected"
    CLOSING = "closing"


_FROM_CLIENT_WHEN_CONNECTED: tuple[type[codec.Packet], ...] = (
    codec.Publish,
    codec.PubAck,
    codec.PubRec,
    codec.PubRel,
    codec.PubComp,
    codec.Subscribe,
    codec.Unsubscribe,
    codec.PingReq,
    codec.Disconnect,
)

_ACCEPTS: dict[ConnectionState, tuple[type[codec.Packet], ...]] = {
    ConnectionState.AWAIT_CONNECT: (codec.Connect,),
    ConnectionState.CONNECTED: _FROM_CLIENT_WHEN_CONNECTED,
    ConnectionState.CLOSING: (),
}


def accepts(state: ConnectionState, packet: codec.Packet) -> bool:
    """Whether a client may send ``packet`` in ``state``; anything else is a protocol
    error that closes the connection (a second CONNECT included, v5 3.1.0-2)."""
    return isinstance(packet, _ACCEPTS[state])
