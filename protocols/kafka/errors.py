"""Typed errors from storage and accounts, as Kafka error codes (a bad peer's kind of
error; anything else is our bug and becomes UNKNOWN_SERVER_ERROR, logged).

Storage that cannot be reached (a storage node down, in the separated form) must get a
code clients retry: KAFKA_STORAGE_ERROR on the data path (producers and consumers
refresh metadata and retry it), COORDINATOR_NOT_AVAILABLE for group and transaction
requests (the Java, librdkafka and kafka-python coordinators retry that one after
finding the coordinator again; an unknown code would be fatal to a commit there)."""

from __future__ import annotations

import logging

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AccessDenied, AuthenticationFailed
from polymq.storage.errors import (
    InvalidArgument,
    InvalidName,
    MessageTooLarge,
    OffsetOutOfRange,
    QueueNotFound,
    StorageUnavailable,
    TopicAlreadyExists,
    TopicNotFound,
)

__all__ = ["coordinator_error", "error_code"]

log = logging.getLogger(__name__)

_CODES: tuple[tuple[type[Exception], ErrorCode], ...] = (
    (StorageUnavailable, ErrorCode.kafka_storage_error),
    (TopicNotFound, ErrorCode.unknown_topic_or_partition),
    (QueueNotFound, ErrorCode.unknown_topic_or_partition),
    (TopicAlreadyExists, ErrorCode.topic_already_exists),
    (InvalidName, ErrorCode.invalid_topic_exception),
    (MessageTooLarge, ErrorCode.message_too_large),
    (OffsetOutOfRange, ErrorCode.offset_out_of_range),
    (InvalidArgument, ErrorCode.invalid_request),
    (AccessDenied, ErrorCode.topic_authorization_failed),
    (AuthenticationFailed, ErrorCode.sasl_authentication_failed),
)


# A permission rule's refusal, by the kind of resource refused (docs/permissions.md).
_DENIED: dict[str | None, ErrorCode] = {
    "group": ErrorCode.group_authorization_failed,
    "transactional_id": ErrorCode.transactional_id_authorization_failed,
}


def error_code(error: Exception) -> ErrorCode:
    if isinstance(error, AccessDenied):
        return _DENIED.get(error.resource, ErrorCode.topic_authorization_failed)
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    log.error("kafka: unexpected error", exc_info=error)
    return ErrorCode.unknown_server_error


def coordinator_error(error: Exception) -> ErrorCode:
    """:func:`error_code` for the coordinator's APIs (offsets, groups, transactions)."""
    if isinstance(error, StorageUnavailable):
        return ErrorCode.coordinator_not_available
    return error_code(error)
