"""The connection and channel state machines as tables (spec sections 2.2.4, 4.2.6).

Each table maps a state to what may arrive in it; anything else is the named error.
The handlers in :mod:`protocols.amqp.connection` and :mod:`protocols.amqp.channel`
consult them instead of scattering ``if`` chains.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Final

from pamqp import commands

__all__ = [
    "CONNECTION_ACCEPTS",
    "ChannelState",
    "ConnectionState",
    "ContentState",
    "content_transition",
]


class ConnectionState(Enum):
    AWAIT_START_OK = auto()
    AWAIT_TUNE_OK = auto()
    AWAIT_OPEN = auto()
    OPEN = auto()
    CLOSING = auto()  # we sent connection.close; only close / close-ok count now


# Which channel-0 methods each connection state accepts, and the state after it.
CONNECTION_ACCEPTS: Final[dict[ConnectionState, dict[type, ConnectionState]]] = {
    ConnectionState.AWAIT_START_OK: {commands.Connection.StartOk: ConnectionState.AWAIT_TUNE_OK},
    ConnectionState.AWAIT_TUNE_OK: {commands.Connection.TuneOk: ConnectionState.AWAIT_OPEN},
    ConnectionState.AWAIT_OPEN: {commands.Connection.Open: ConnectionState.OPEN},
    ConnectionState.OPEN: {
        commands.Connection.Close: ConnectionState.CLOSING,
        commands.Connection.Blocked: ConnectionState.OPEN,
        commands.Connection.Unblocked: ConnectionState.OPEN,
        commands.Connection.UpdateSecret: ConnectionState.OPEN,
    },
    ConnectionState.CLOSING: {
        commands.Connection.Close: ConnectionState.CLOSING,
        commands.Connection.CloseOk: ConnectionState.CLOSING,
    },
}


class ChannelState(Enum):
    OPEN = auto()
    CLOSING = auto()  # we sent channel.close; everything but close / close-ok is dropped


class ContentState(Enum):
    """Where a channel is in reading a content-bearing method (section 4.2.6)."""

    METHOD = auto()  # expecting a method frame
    HEADER = auto()  # after basic.publish: expecting its content header
    BODY = auto()  # expecting body frames until body_size bytes arrived


# (state, frame kind) -> next state; a missing pair is UNEXPECTED_FRAME (505).
_CONTENT_TABLE: Final[dict[tuple[ContentState, str], ContentState]] = {
    (ContentState.METHOD, "method"): ContentState.METHOD,
    (ContentState.METHOD, "content-method"): ContentState.HEADER,
    (ContentState.HEADER, "header"): ContentState.BODY,
    (ContentState.BODY, "body"): ContentState.BODY,
}


def content_transition(state: ContentState, kind: str) -> ContentState | None:
    """The state after a frame of ``kind`` (method, content-method, header, body), or
    ``None`` if the frame may not arrive now."""
    return _CONTENT_TABLE.get((state, kind))
