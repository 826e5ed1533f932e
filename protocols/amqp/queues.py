"""An AMQP queue's definition and what every gateway knows of its consumers.

A plain queue is the storage topic ``amqp:<name>`` with one storage queue per
priority level (``x-max-priority``), popped by the group :data:`GROUP`. A *view*
(declared with ``x-polymq-topic: T``, docs/interop.md) has no topic of its own: it
pops every queue of the storage topic ``T`` with a group of its own, ``amqp:<name>``,
so two views of one topic each get every message, and ``T`` is left to its owner.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from polymq.protocols import interop
from polymq.storage.model import QueueRef

__all__ = [
    "GROUP",
    "MAX_PRIORITY",
    "TOPIC_PREFIX",
    "ConsumerEntry",
    "QueueConsumer",
    "QueueDef",
    "json_safe",
]

GROUP: Final = "amqp"
TOPIC_PREFIX: Final = "amqp:"
MAX_PRIORITY: Final = 10  # storage queues per AMQP queue, at most (RabbitMQ allows 255)


def json_safe(value: Any) -> Any:
    """An AMQP field value as JSON (metadata is stored as JSON)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime):
        return int(value.timestamp())
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)


class QueueConsumer(Protocol):
    """What the vhost needs of a consumer in this gateway: to tell it its queue went
    away, or that it may have become the single active one."""

    exclusive: bool
    id: str  # unique across gateways: its key in QueueDef.registry

    def queue_deleted(self) -> None: ...

    def wake(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ConsumerEntry:
    """A consumer on some gateway. ``serial``: the offset of its registration in the
    vhost's change log, one order for all gateways (single-active-consumer's line)."""

    serial: int
    exclusive: bool
    instance: str  # the gateway instance it is connected to


@dataclass(kw_only=True, eq=False)
class QueueDef:
    name: str
    durable: bool = False
    exclusive_owner: str | None = None  # the declaring connection's key (any gateway)
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    # Tells a queue declared again (deleted and re-made) from the one a gateway knew.
    uid: str = field(default_factory=lambda: secrets.token_hex(8))
    # The gateway instance whose end ends a transient or exclusive queue ("" none).
    home: str = ""
    consumers: set[QueueConsumer] = field(default_factory=set)  # in this gateway
    registry: dict[str, ConsumerEntry] = field(default_factory=dict)  # in every gateway
    ever_consumed: bool = False
    sweeping: asyncio.Lock = field(default_factory=asyncio.Lock)  # expiry passes
    last_used: float = 0.0
    touched: float = 0.0  # when this gateway last told the others of a use
    view_queues: int = 0  # a view's storage queue count, 0 until its topic is seen

    @property
    def view_topic(self) -> str | None:
        value = self.arguments.get(interop.AMQP_TOPIC_ARGUMENT)
        return value if isinstance(value, str) and value else None

    @property
    def topic(self) -> str:
        """The storage topic the queue's messages are in."""
        return self.view_topic or TOPIC_PREFIX + self.name

    @property
    def group(self) -> str:
        """The pop group: shared by plain queues (each has its own topic), one per view."""
        return GROUP if self.view_topic is None else TOPIC_PREFIX + self.name

    @property
    def is_stream(self) -> bool:
        """A RabbitMQ stream: read by offset, acks do not remove messages."""
        return self.arguments.get("x-queue-type") == "stream"

    @property
    def single_active(self) -> bool:
        """``x-single-active-consumer``: one consumer at a time gets deliveries, the
        first registered (on any gateway); the next takes over when it goes."""
        return self.arguments.get("x-single-active-consumer") is True

    def active_id(self) -> str | None:
        if not self.registry:
            return None
        return min(self.registry.items(), key=lambda item: item[1].serial)[0]

    @property
    def consumer_count(self) -> int:
        return len(self.registry.keys() | {c.id for c in self.consumers})

    @property
    def max_priority(self) -> int:
        value = self.arguments.get("x-max-priority")
        return max(0, min(MAX_PRIORITY, value)) if isinstance(value, int) else 0

    def refs(self, namespace: str) -> tuple[QueueRef, ...]:
        """The storage queues, highest priority first (a view: its topic's queues)."""
        if self.view_topic is not None:
            return tuple(QueueRef(namespace, self.view_topic, i) for i in range(self.view_queues))
        return tuple(QueueRef(namespace, self.topic, p) for p in range(self.max_priority, -1, -1))

    def ref_for(self, namespace: str, priority: int | None) -> QueueRef:
        return QueueRef(namespace, self.topic, max(0, min(self.max_priority, priority or 0)))

    def int_argument(self, name: str) -> int | None:
        value = self.arguments.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def to_json(self) -> dict[str, Any]:
        return {
            "durable": self.durable,
            "exclusive": self.exclusive_owner is not None,
            "owner": self.exclusive_owner,
            "auto_delete": self.auto_delete,
            "arguments": self.arguments,
            "uid": self.uid,
            "home": self.home,
        }

    @staticmethod
    def from_json(name: str, value: Mapping[str, Any]) -> QueueDef:
        owner = value.get("owner")
        if value.get("exclusive") and not isinstance(owner, str):
            owner = "?"  # written before owners were kept: nobody's any more
        return QueueDef(
            name=name,
            durable=bool(value["durable"]),
            exclusive_owner=owner if isinstance(owner, str) else None,
            auto_delete=bool(value["auto_delete"]),
            arguments=dict(value["arguments"]),
            uid=str(value.get("uid") or secrets.token_hex(8)),
            home=str(value.get("home") or ""),
        )
