"""RocketMQ 5 status codes: the one place where a failure becomes a ``Status``.

Every RPC answers with a ``Status`` in its response, never with an unhandled exception
(an exception would reach the client as a bare gRPC INTERNAL with no code it knows).
Peer mistakes raise :class:`RpcFailure` with the code the official clients expect;
typed storage and auth errors are translated by :func:`status_for`.
"""

from __future__ import annotations

import logging
from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2

from polymq.gateway.accounts import AccessDenied, AuthenticationFailed, AuthError
from polymq.storage import errors

__all__ = ["Code", "Malformed", "RpcFailure", "log_refusal", "ok", "status", "status_for"]

log = logging.getLogger(__name__)


class RpcFailure(Exception):
    """A request the client got wrong (or may not make): answered with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Malformed:
    """Stands in for a request whose bytes are not the RPC's protobuf message, so the
    handler can answer BAD_REQUEST (grpc would fail the call before our code runs)."""

    def __init__(self, error: str) -> None:
        self.error = error

    def status(self) -> Any:
        return status(Code.BAD_REQUEST, f"malformed request: {self.error}")


_STORAGE_CODES: dict[type[errors.StorageError], int] = {
    errors.TopicNotFound: Code.TOPIC_NOT_FOUND,
    errors.QueueNotFound: Code.TOPIC_NOT_FOUND,
    errors.GroupNotFound: Code.CONSUMER_GROUP_NOT_FOUND,
    errors.NamespaceNotFound: Code.FORBIDDEN,
    errors.MessageTooLarge: Code.MESSAGE_BODY_TOO_LARGE,
    errors.InvalidReceipt: Code.INVALID_RECEIPT_HANDLE,
    errors.TransactionNotFound: Code.INVALID_TRANSACTION_ID,
    errors.OffsetOutOfRange: Code.ILLEGAL_OFFSET,
    errors.InvalidName: Code.BAD_REQUEST,
    errors.InvalidArgument: Code.BAD_REQUEST,
    # The storage node holding the resource is out of reach (the separated form): the
    # clients treat 50002 as a server error and retry (producers on another queue).
    errors.StorageUnavailable: Code.HA_NOT_AVAILABLE,
    errors.StorageClosed: Code.INTERNAL_SERVER_ERROR,
    errors.StorageFailed: Code.INTERNAL_SERVER_ERROR,
}


# Refusals of requests no well-behaved client sends: one line each, so an operator sees
# who sends them; the everyday ones (not found, expired receipt) are not logged.
_LOGGED = frozenset(
    {
        Code.BAD_REQUEST,
        Code.PAYLOAD_TOO_LARGE,
        Code.MESSAGE_BODY_TOO_LARGE,
        Code.MESSAGE_PROPERTIES_TOO_LARGE,
        Code.MESSAGE_CORRUPTED,
        Code.ILLEGAL_FILTER_EXPRESSION,
        Code.ILLEGAL_ACCESS_POINT,
    }
)


def log_refusal(method: str, peer: str, answer: Any) -> None:
    """One log line for a refused hostile or malformed request (no traceback)."""
    if answer.code in _LOGGED:
        log.info(
            "rocketmq: %s from %s refused with %s: %.200s",
            method,
            peer,
            Code.Name(answer.code),
            answer.message,
        )


def status(code: int, message: str = "") -> Any:
    return definition_pb2.Status(code=code, message=message)


_OK = definition_pb2.Status(code=Code.OK, message="OK")


def ok() -> Any:
    """The OK status, shared: a response copies a status given to it, so it is never
    changed through a response (build a fresh one with :func:`status` to edit)."""
    return _OK


def status_for(error: BaseException) -> Any:
    """The ``Status`` answering ``error``; our own bugs are logged loudly and answered
    INTERNAL_ERROR, so only that one request fails."""
    if isinstance(error, RpcFailure):
        return status(error.code, error.message)
    if isinstance(error, errors.StorageError):
        for cls in type(error).__mro__:
            code = _STORAGE_CODES.get(cls)
            if code is not None:
                return status(code, str(error))
        return status(Code.INTERNAL_SERVER_ERROR, str(error))
    if isinstance(error, AuthenticationFailed):
        return status(Code.UNAUTHORIZED, str(error))
    if isinstance(error, AccessDenied | AuthError):
        return status(Code.FORBIDDEN, str(error))
    log.error("rocketmq: request failed on a server bug", exc_info=error)
    return status(Code.INTERNAL_ERROR, f"internal error: {type(error).__name__}")
