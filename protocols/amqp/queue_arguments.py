"""What a queue.declare may ask for, and when a declare matches the queue that exists.

Checked before anything is stored, so a refused declare leaves no trace; the
messages follow RabbitMQ's (``inequivalent arg ...``), which clients show to users.
"""

from __future__ import annotations

from typing import Final

from polymq.protocols.amqp import errors
from polymq.protocols.amqp.changes import CHANGES_TOPIC
from polymq.protocols.amqp.errors import ChannelError
from polymq.protocols.amqp.queues import TOPIC_PREFIX, QueueDef
from polymq.storage.errors import InvalidName
from polymq.storage.names import check_name

__all__ = ["check_equivalent", "validate_arguments", "validate_view"]

_IDS: Final = (50, 10)  # queue.declare
# Arguments compared on re-declare (RabbitMQ's "inequivalent arg" check).
_QUEUE_EQUIVALENCE: Final = (
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-queue-type",
    "x-single-active-consumer",
    "x-polymq-topic",
)


def _refuse(text: str) -> ChannelError:
    return ChannelError(errors.PRECONDITION_FAILED, text, *_IDS)


def validate_arguments(queue: QueueDef) -> None:
    if queue.is_stream and (
        not queue.durable or queue.exclusive_owner is not None or queue.auto_delete
    ):
        raise _refuse(
            f"stream queue '{queue.name}' must be durable, not exclusive, not auto-delete"
        )
    for name in ("x-message-ttl", "x-expires", "x-max-length", "x-max-priority"):
        value = queue.arguments.get(name)
        if value is not None and (not isinstance(value, int) or value < 0):
            raise _refuse(f"invalid arg '{name}' for queue '{queue.name}': {value!r}")
    if queue.arguments.get("x-expires") == 0:
        raise _refuse("invalid arg 'x-expires': must be positive")
    overflow = queue.arguments.get("x-overflow", "drop-head")
    if overflow not in ("drop-head", "reject-publish", "reject-publish-dlx"):
        raise _refuse(f"invalid arg 'x-overflow': {overflow!r}")
    validate_view(queue)


def validate_view(queue: QueueDef) -> None:
    """``x-polymq-topic``: a storage topic's name, not an AMQP queue's own topic or
    polymq's bookkeeping; not combined with streams or priorities."""
    key = "x-polymq-topic"
    if key not in queue.arguments:
        return
    topic = queue.arguments[key]
    try:
        check_name("topic", topic)
    except InvalidName as e:
        raise _refuse(f"invalid arg '{key}': {e}") from e
    if topic.startswith((TOPIC_PREFIX, "%")) or topic == CHANGES_TOPIC:
        raise _refuse(f"invalid arg '{key}': {topic!r} is not a storage topic a view may read")
    for other in ("x-queue-type", "x-max-priority"):
        if other in queue.arguments and not (
            other == "x-queue-type" and queue.arguments[other] in ("classic", "quorum")
        ):
            raise _refuse(f"'{key}' cannot be combined with '{other}' (queue '{queue.name}')")


def check_equivalent(queue: QueueDef, wanted: QueueDef) -> None:
    """A declare of an existing ``queue`` must ask for what it is (RabbitMQ refuses
    the channel otherwise, rather than changing the queue under its users)."""
    durable = wanted.durable
    if queue.durable != durable:
        raise _refuse(
            f"inequivalent arg 'durable' for queue '{queue.name}': received"
            f" '{str(durable).lower()}' but current is '{str(queue.durable).lower()}'"
        )
    for key in _QUEUE_EQUIVALENCE:
        given = wanted.arguments.get(key)
        if given != queue.arguments.get(key):
            raise _refuse(
                f"inequivalent arg '{key}' for queue '{queue.name}': received {given!r}"
                f" but current is {queue.arguments.get(key)!r}"
            )
