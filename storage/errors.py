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
    "NotSent",
    "OffsetOutOfRange",
    "QueueNotFound",
    "ShardAway",
    "ShardMoved",
    "StorageClosed",
    "StorageError",
    "StorageFailed",
    "StorageUnavailable",
    "TopicAlreadyExists",
    "TopicNotFound",
    "TransactionNotFound",
    "error_from_code",
]

_BY_CODE: dict[str, type[StorageError]] = {}


class StorageError(Exception):
    """Base of every error the storage API raises on purpose.

    A subclass names its stable wire code in its class statement,
    ``class TopicNotFound(StorageError, code="topic_not_found")``, which also
    registers it for :func:`error_from_code`.
    """

    code = "storage_error"

    def __init_subclass__(cls, *, code: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code in _BY_CODE:
            raise TypeError(f"storage error code {code!r} is taken by {_BY_CODE[code].__name__}")
        cls.code = code
        _BY_CODE[code] = cls


_BY_CODE[StorageError.code] = StorageError


class InvalidName(StorageError, code="invalid_name"):
    pass


class InvalidArgument(StorageError, code="invalid_argument"):
    pass


class NamespaceNotFound(StorageError, code="namespace_not_found"):
    pass


class NamespaceAlreadyExists(StorageError, code="namespace_already_exists"):
    pass


class TopicNotFound(StorageError, code="topic_not_found"):
    pass


class TopicAlreadyExists(StorageError, code="topic_already_exists"):
    pass


class QueueNotFound(StorageError, code="queue_not_found"):
    pass


class GroupNotFound(StorageError, code="group_not_found"):
    pass


class MessageTooLarge(StorageError, code="message_too_large"):
    pass


class InvalidReceipt(StorageError, code="invalid_receipt"):
    """The receipt handle is malformed, belongs to another group or namespace, or is
    stale: the message was acked or handed out again since the receipt was issued."""


class OffsetOutOfRange(StorageError, code="offset_out_of_range"):
    """The offset is below the queue's earliest retained offset or above its end."""

    def __init__(self, message: str, *, earliest: int = 0, latest: int = 0) -> None:
        super().__init__(message)
        self.earliest = earliest
        self.latest = latest


class TransactionNotFound(StorageError, code="transaction_not_found"):
    pass


class StorageClosed(StorageError, code="storage_closed"):
    pass


class StorageFailed(StorageError, code="storage_failed"):
    """A write to disk failed. The engine stops accepting writes (fail-stop) rather
    than risk acknowledging data it may not have, as PostgreSQL does after an fsync
    error."""


class StorageUnavailable(StorageError, code="storage_unavailable"):
    """The storage node that owns the resource cannot be reached right now (separated
    form: the node is down, restarting, or not yet registered with a nameserver). The
    request may or may not have taken effect: refused before it was sent, it did not;
    lost with its connection (the node died while answering), or spread over several
    nodes, it may have. Retry it, with its dedup key when it has one. Adapters answer
    with their protocol's retryable error."""


class NotSent(StorageUnavailable, code="not_sent"):
    """The request to ``target`` took no effect: no connection could be opened, so it
    never left, or the server was handing over (a shard passing to another process)
    and refused it unrun. Sending it again, to wherever the routes now say, cannot do
    it twice."""

    def __init__(self, message: str, *, target: str = "") -> None:
        super().__init__(message)
        self.target = target


class ShardAway(StorageUnavailable, code="shard_away"):
    """The replicated pool's shard holding the resource is between owners: its process
    died or is handing it over, and another serves it within the takeover time (a
    lease time plus a rebuild). Unlike a node that is down, it comes back without
    anyone restarting anything, so a waiting consumer waits on (as RabbitMQ's quorum
    queue consumers wait for a new leader) instead of giving up. Whether the request
    took effect is as :class:`StorageUnavailable` says."""


class ShardMoved(ShardAway, code="shard_moved"):
    """This node no longer owns the shard: its lease passed to another node, whose
    appends fenced this one's off the shard's replicated log. The request did not take
    effect; the shard's route changes to the new owner within a takeover."""


def error_from_code(code: str, message: str) -> StorageError:
    """Rebuild a typed error received over the network from its stable code."""
    return _BY_CODE.get(code, StorageError)(message)
