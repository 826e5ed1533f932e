"""Typed errors raised across the storage API.

Every error a caller can provoke is a subclass of :class:`StorageError` and carries a
``code`` that stays stable across the network (the cluster client re-raises the same
class from the code), so protocol adapters can map them to their own wire errors
without parsing messages.
"""

from __future__ import annotations

__all__ = [
    "GroupNotFound",
    "InvalidArgument",
    "InvalidName",
    "InvalidReceipt",
    "MessageTooLarge",
    "NamespaceAlreadyExists",
    "NamespaceNotFound",
    "OffsetOutOfRange",
    "QueueNotFound",
    "StorageClosed",
    "StorageError",
    "StorageFailed",
    "StorageUnavailable",
    "TopicAlreadyExists",
    "TopicNotFound",
    "TransactionNotFound",
    "error_from_code",
]


class StorageError(Exception):
    """Base of every error the storage API raises on purpose."""

    code = "storage_error"


class InvalidName(StorageError):
    code = "invalid_name"


class InvalidArgument(StorageError):
    code = "invalid_argument"


class NamespaceNotFound(StorageError):
    code = "namespace_not_found"


class NamespaceAlreadyExists(StorageError):
    code = "namespace_already_exists"


class TopicNotFound(StorageError):
    code = "topic_not_found"


class TopicAlreadyExists(StorageError):
    code = "topic_already_exists"


class QueueNotFound(StorageError):
    code = "queue_not_found"


class GroupNotFound(StorageError):
    code = "group_not_found"


class MessageTooLarge(StorageError):
    code = "message_too_large"


class InvalidReceipt(StorageError):
    """The receipt handle is malformed, belongs to another group or namespace, or is
    stale: the message was acked or handed out again since the receipt was issued."""

    code = "invalid_receipt"


class OffsetOutOfRange(StorageError):
    """The offset is below the queue's earliest retained offset or above its end."""

    code = "offset_out_of_range"

    def __init__(self, message: str, *, earliest: int = 0, latest: int = 0) -> None:
        super().__init__(message)
        self.earliest = earliest
        self.latest = latest


class TransactionNotFound(StorageError):
    code = "transaction_not_found"


class StorageClosed(StorageError):
    code = "storage_closed"


class StorageFailed(StorageError):
    """A write to disk failed. The engine stops accepting writes (fail-stop) rather
    than risk acknowledging data it may not have, as PostgreSQL does after an fsync
    error."""

    code = "storage_failed"


class StorageUnavailable(StorageError):
    """The storage node that owns the resource cannot be reached right now (separated
    form: the node is down, restarting, or not yet registered with a nameserver). The
    request did not take effect, or, for an append spread over several nodes, may have
    taken effect on some of them: retry it, with its dedup key when it has one.
    Adapters answer with their protocol's retryable error."""

    code = "storage_unavailable"


_BY_CODE: dict[str, type[StorageError]] = {
    cls.code: cls
    for cls in (
        StorageError,
        InvalidName,
        InvalidArgument,
        NamespaceNotFound,
        NamespaceAlreadyExists,
        TopicNotFound,
        TopicAlreadyExists,
        QueueNotFound,
        GroupNotFound,
        MessageTooLarge,
        InvalidReceipt,
        OffsetOutOfRange,
        TransactionNotFound,
        StorageClosed,
        StorageFailed,
        StorageUnavailable,
    )
}


def error_from_code(code: str, message: str) -> StorageError:
    """Rebuild a typed error received over the network from its stable code."""
    return _BY_CODE.get(code, StorageError)(message)
