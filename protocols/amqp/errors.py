"""AMQP reply codes (spec section 1.2, "Constants") and the two kinds of peer error.

A :class:`ChannelError` closes only its channel (soft error: 404, 405, 406, 403 on a
resource); a :class:`ConnectionError_` closes the whole connection (hard error: 501,
503, 504, 505, 530, 541). Handlers raise them; the connection turns them into
channel.close / connection.close naming the offending method.
"""

from __future__ import annotations

from typing import Final

from polymq.storage.errors import (
    InvalidArgument,
    InvalidName,
    MessageTooLarge,
    StorageError,
    StorageUnavailable,
    TopicNotFound,
)

__all__ = [
    "ACCESS_REFUSED",
    "CHANNEL_ERROR",
    "COMMAND_INVALID",
    "CONNECTION_FORCED",
    "FRAME_ERROR",
    "INTERNAL_ERROR",
    "NOT_ALLOWED",
    "NOT_FOUND",
    "NOT_IMPLEMENTED",
    "NO_ROUTE",
    "PRECONDITION_FAILED",
    "REPLY_SUCCESS",
    "RESOURCE_LOCKED",
    "SYNTAX_ERROR",
    "UNEXPECTED_FRAME",
    "AmqpError",
    "ChannelError",
    "ConnectionError_",
    "from_storage",
]

REPLY_SUCCESS: Final = 200
NO_ROUTE: Final = 312
CONNECTION_FORCED: Final = 320
ACCESS_REFUSED: Final = 403
NOT_FOUND: Final = 404
RESOURCE_LOCKED: Final = 405
PRECONDITION_FAILED: Final = 406
FRAME_ERROR: Final = 501
SYNTAX_ERROR: Final = 502
COMMAND_INVALID: Final = 503
CHANNEL_ERROR: Final = 504
UNEXPECTED_FRAME: Final = 505
NOT_ALLOWED: Final = 530
NOT_IMPLEMENTED: Final = 540
INTERNAL_ERROR: Final = 541

_NAMES: Final = {
    NO_ROUTE: "NO_ROUTE",
    CONNECTION_FORCED: "CONNECTION_FORCED",
    ACCESS_REFUSED: "ACCESS_REFUSED",
    NOT_FOUND: "NOT_FOUND",
    RESOURCE_LOCKED: "RESOURCE_LOCKED",
    PRECONDITION_FAILED: "PRECONDITION_FAILED",
    FRAME_ERROR: "FRAME_ERROR",
    SYNTAX_ERROR: "SYNTAX_ERROR",
    COMMAND_INVALID: "COMMAND_INVALID",
    CHANNEL_ERROR: "CHANNEL_ERROR",
    UNEXPECTED_FRAME: "UNEXPECTED_FRAME",
    NOT_ALLOWED: "NOT_ALLOWED",
    NOT_IMPLEMENTED: "NOT_IMPLEMENTED",
    INTERNAL_ERROR: "INTERNAL_ERROR",
}


class AmqpError(Exception):
    """A peer error with its reply code; ``reply_text`` is RabbitMQ-styled
    (``NOT_FOUND - no queue 'x' in vhost '/'``), which clients show to users."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        super().__init__(text)
        self.code = code
        self.class_id = class_id
        self.method_id = method_id
        self.reply_text = f"{_NAMES.get(code, str(code))} - {text}"[:255]


class ChannelError(AmqpError):
    """Closes the channel only."""


class ConnectionError_(AmqpError):
    """Closes the connection."""


def from_storage(error: StorageError, class_id: int = 0, method_id: int = 0) -> AmqpError:
    """The AMQP error for a storage error met while handling a method (``class_id``,
    ``method_id``): what the peer can cause, or what concerns one queue, closes only
    the channel (an unavailable storage node is RabbitMQ's 404 for a queue whose node
    is down, docs/cluster.md); anything else is ours, and closes the connection."""
    text = str(error)
    if isinstance(error, TopicNotFound | StorageUnavailable):
        return ChannelError(NOT_FOUND, text, class_id, method_id)
    if isinstance(error, InvalidName | InvalidArgument | MessageTooLarge):
        return ChannelError(PRECONDITION_FAILED, text, class_id, method_id)
    return ConnectionError_(INTERNAL_ERROR, text, class_id, method_id)
