"""MNS errors: the code and HTTP status a bad request gets (MNS API reference, "Error
codes"), and the translation of the gateway's typed errors into them."""

from __future__ import annotations

from polymq.gateway.accounts import AccessDenied, AuthenticationFailed, AuthError
from polymq.storage import errors as storage_errors

__all__ = ["MnsError", "from_exception"]


class MnsError(Exception):
    """A request the peer got wrong (or a resource state it must hear about). The
    listener renders it as an ``<Error>`` document with ``status``."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.headers: dict[str, str] = {}  # extra response headers (Retry-After)

    @classmethod
    def invalid_argument(cls, message: str) -> MnsError:
        return cls("InvalidArgument", message, 400)

    @classmethod
    def malformed(cls, message: str) -> MnsError:
        return cls("MalformedXML", message, 400)

    @classmethod
    def queue_not_exist(cls, name: str) -> MnsError:
        return cls("QueueNotExist", f"The queue name you provided is not exist: {name}.", 404)

    @classmethod
    def topic_not_exist(cls, name: str) -> MnsError:
        return cls("TopicNotExist", f"The topic name you provided is not exist: {name}.", 404)

    @classmethod
    def subscription_not_exist(cls, name: str) -> MnsError:
        return cls(
            "SubscriptionNotExist", f"The subscription you provided is not exist: {name}.", 404
        )

    @classmethod
    def message_not_exist(cls) -> MnsError:
        return cls("MessageNotExist", "Message not exist.", 404)

    @classmethod
    def receipt_handle(cls, message: str) -> MnsError:
        return cls("ReceiptHandleError", message, 400)

    @classmethod
    def body_too_long(cls, limit: int) -> MnsError:
        return cls("MessageBodyTooLong", f"The message body is longer than {limit} bytes.", 400)


_STORAGE: dict[type[storage_errors.StorageError], tuple[str, int]] = {
    storage_errors.InvalidReceipt: ("ReceiptHandleError", 400),
    storage_errors.MessageTooLarge: ("MessageBodyTooLong", 400),
    storage_errors.InvalidName: ("InvalidArgument", 400),
    storage_errors.InvalidArgument: ("InvalidArgument", 400),
    storage_errors.NamespaceNotFound: ("AccessDenied", 403),
    storage_errors.TopicNotFound: ("QueueNotExist", 404),
    storage_errors.QueueNotFound: ("QueueNotExist", 404),
    storage_errors.StorageClosed: ("ServiceUnavailable", 503),
    storage_errors.StorageUnavailable: ("ServiceUnavailable", 503),
    storage_errors.StorageFailed: ("InternalError", 500),
}


def from_exception(error: Exception) -> MnsError | None:
    """The MNS form of a typed gateway or storage error; ``None`` for anything else
    (our bug: the caller logs it and answers InternalError)."""
    if isinstance(error, MnsError):
        return error
    if isinstance(error, AuthenticationFailed):
        return MnsError("InvalidAccessKeyId", str(error), 403)
    if isinstance(error, AccessDenied | AuthError):
        return MnsError("AccessDenied", str(error), 403)
    if isinstance(error, storage_errors.StorageError):
        # The nearest mapped class: a subclass (ShardAway, ShardMoved: a shard between
        # owners) answers as its base (ServiceUnavailable), not InternalError.
        mapped = (_STORAGE.get(cls) for cls in type(error).__mro__)
        code, status = next((m for m in mapped if m is not None), ("InternalError", 500))
        return MnsError(code, str(error), status)
    return None
