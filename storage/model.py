"""The abstract message model shared by every protocol (docs/architecture.md).

Everything here is plain, immutable data: it crosses the storage API unchanged and,
in the Cluster form, the network. No protocol's types appear here; adapters map their
frames onto these classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from enum import StrEnum
from typing import Any, TypeVar

__all__ = [
    "DEFAULT_NAMESPACE",
    "UNLIMITED",
    "AppendRequest",
    "AppendResult",
    "BatchEntry",
    "CommittedOffset",
    "GroupConfig",
    "HalfMessage",
    "Message",
    "MessageType",
    "Placement",
    "QueueOffsets",
    "QueueRef",
    "ReadResult",
    "StoredBatch",
    "StoredMessage",
    "TopicConfig",
    "TopicInfo",
]

_T = TypeVar("_T")


def _quick_init(cls: type[_T]) -> type[_T]:
    """Give a frozen, slotted dataclass an ``__init__`` that stores each field
    through its slot's descriptor instead of ``object.__setattr__`` looked up per
    field: the same signature, defaults and immutability, about 40 % less time per
    instance. Several of these are built per message on the storage path (issue 21:
    their ``__init__`` was 9 % of the server's samples). A class with a
    ``default_factory`` or a ``__post_init__`` keeps the generated one."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__post_init__") or any(f.default_factory is not MISSING for f in fields):
        return cls
    namespace: dict[str, object] = {}
    params: list[str] = []
    lines: list[str] = []
    keyword_only = False
    for f in sorted(fields, key=lambda f: f.kw_only is True):  # positional ones first
        if f.kw_only and not keyword_only:
            params.append("*")
            keyword_only = True
        if f.default is MISSING:
            params.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        namespace[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        lines.append(f"    _set_{f.name}(self, {f.name})")
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(lines or ["    pass"])
    exec(source, namespace)  # built from the class's own field names only
    init: Any = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    setattr(cls, "__init__", init)  # noqa: B010 - mypy refuses assigning a method
    return cls


DEFAULT_NAMESPACE = "default"
UNLIMITED = -1  # TopicConfig retention: keep until deleted (Kafka's retention.ms=-1)


class MessageType(StrEnum):
    """What a topic accepts, as RocketMQ 5 types topics."""

    NORMAL = "NORMAL"
    FIFO = "FIFO"
    DELAY = "DELAY"
    TRANSACTION = "TRANSACTION"


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicConfig:
    """A topic's settings.

    Retention: ``None`` means the engine's default (whole commit-log segments are
    deleted past the engine's ``retention_ms`` / ``retention_bytes``); a positive value
    also hides older messages of this topic; ``UNLIMITED`` (-1, Kafka's convention)
    keeps every message until a consumer removes it with ``delete_records``, as an AMQP
    queue does: segments holding them are never deleted.
    ``max_message_bytes`` bounds one message's body (and a batch entry's raw bytes).
    ``internal``: a topic a protocol keeps for its own bookkeeping (an MQTT session's
    queue): ``list_topics`` leaves it out unless asked, so other protocols' listings
    (Kafka metadata, RocketMQ, the admin API) show only what users created."""

    queue_count: int = 1
    message_type: MessageType = MessageType.NORMAL
    retention_ms: int | None = None
    retention_bytes: int | None = None
    max_message_bytes: int | None = None
    internal: bool = False


@_quick_init
@dataclass(frozen=True, slots=True)
class QueueRef:
    """One append-only log with dense offsets: a Kafka partition, a RocketMQ message
    queue, an AMQP queue, an MNS queue, an MQTT session's queue."""

    namespace: str
    topic: str
    queue_id: int = 0

    def __str__(self) -> str:
        return f"{self.namespace}/{self.topic}[{self.queue_id}]"


@_quick_init
@dataclass(frozen=True, slots=True)
class QueueOffsets:
    """``earliest`` is the first retained offset, ``latest`` the next offset to be
    written (Kafka's log-start offset and high watermark)."""

    earliest: int
    latest: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicInfo:
    namespace: str
    name: str
    config: TopicConfig
    queues: tuple[QueueOffsets, ...] = ()
    created_ms: int = 0
    modified_ms: int = 0


@_quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """What a producer sends, in every protocol's terms.

    ``properties`` keeps order and repeats (MQTT user properties may repeat a name).
    ``delivery_time_ms`` (absolute, epoch ms) delays visibility; ``expiry_ms``
    (absolute) drops the message from pop consumers after that time.
    """

    body: bytes = b""
    key: bytes | None = None
    tag: str | None = None
    properties: tuple[tuple[str, bytes], ...] = ()
    message_group: str | None = None
    delivery_time_ms: int | None = None
    expiry_ms: int | None = None
    content_type: str | None = None
    correlation_id: bytes | None = None
    reply_to: str | None = None
    producer: str | None = None
    born_timestamp_ms: int | None = None
    born_host: str | None = None

    def property(self, name: str) -> bytes | None:
        """The first value of ``name``, or ``None``."""
        for key, value in self.properties:
            if key == name:
                return value
        return None


@_quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class BatchEntry:
    """A producer batch kept as one stored entry spanning ``count`` offsets.

    ``raw`` is served back byte for byte by ``read_batches`` (a Kafka record batch is
    returned as produced); other protocols read it one message at a time. ``format``
    names the producer's encoding of ``raw`` (e.g. ``"kafka.v2"``).

    Either give ``messages`` (stored beside ``raw``), or leave them out and give
    ``count``: then ``format`` must be registered in :mod:`storage.batch_formats`, and
    readers expand ``raw`` when they want messages, so the bytes are stored once.
    """

    format: str
    raw: bytes
    messages: tuple[Message, ...] = ()
    count: int = 0

    @property
    def size(self) -> int:
        """How many offsets the entry spans."""
        return len(self.messages) or self.count


@_quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class AppendRequest:
    """One message (or batch entry) stored once and indexed into every queue in
    ``queues`` (multi-dispatch: an AMQP fanout or an MQTT publish to many sessions
    costs one body write).

    ``dedup_key``: an append whose key was seen in the same namespace within the
    engine's dedup window is not stored again; it returns the first append's result
    (SQS FIFO deduplication ids, MQTT QoS 2 and Kafka idempotent-producer retries).
    The key is recorded atomically with the message, so a retry after a crash is
    recognised too.

    ``durable``: what the client asked for. ``True`` (persistent AMQP messages to a
    durable queue, MQTT QoS 1/2, Kafka ``acks=all``): the append returns once the
    message is fsynced (``sync`` durability). ``False`` (transient messages, QoS 0,
    ``acks=0``/``1``): it returns once the message is written (it survives a crash of
    the process, not of the machine) and is fsynced within the flush interval or with
    the next durable append, whichever comes first."""

    entry: Message | BatchEntry
    queues: tuple[QueueRef, ...]
    dedup_key: str | None = None
    # Normally the store names the message. The cluster client names one whose queues
    # sit on several storage nodes, so every copy carries the same id.
    message_id: str | None = None
    durable: bool = True


@_quick_init
@dataclass(frozen=True, slots=True)
class Placement:
    """Where one dispatch of an appended entry landed: its first offset in a queue."""

    queue: QueueRef
    offset: int


@_quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class AppendResult:
    """``placements`` is empty while the message is delayed or a transaction half:
    it gets offsets when it becomes visible. ``duplicate``: the request's dedup key was
    seen within the window, nothing was stored, this is the first append's result."""

    message_id: str
    store_timestamp_ms: int
    placements: tuple[Placement, ...] = ()
    duplicate: bool = False


@_quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StoredMessage:
    """A message as read back: the producer's message plus where and when it was
    stored. ``delivery_attempt`` counts pop deliveries, starting at 1 (0 on offset
    reads); ``receipt`` is set on pop and is what ack/nack take."""

    message: Message
    queue: QueueRef
    offset: int
    message_id: str
    store_timestamp_ms: int
    delivery_attempt: int = 0
    receipt: str | None = None
    first_pop_ms: int | None = None
    next_visible_ms: int | None = None


@_quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class StoredBatch:
    """A stored entry as read back for pass-through: ``raw`` exactly as produced for
    batch entries (``format`` set), ``base_offset`` its first offset."""

    queue: QueueRef
    base_offset: int
    count: int
    store_timestamp_ms: int
    format: str | None
    raw: bytes | None
    messages: tuple[StoredMessage, ...] = ()


@_quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ReadResult:
    """``next_offset`` is where the next read continues; ``offsets`` the queue's
    bounds when the read finished."""

    messages: tuple[StoredMessage, ...]
    next_offset: int
    offsets: QueueOffsets


@dataclass(frozen=True, slots=True, kw_only=True)
class CommittedOffset:
    offset: int
    metadata: str = ""
    commit_ms: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupConfig:
    """A consumer group's pop-mode policy.

    ``max_delivery_attempts``: a message is handed out at most this many times; the
    next time it would be, it goes to the group's dead-letter queue (``None``: never).
    ``fifo``: within each message group, the next message is handed out only after
    the previous one is acked. ``dead_letter_topic`` defaults to ``%DLQ%<group>``.
    """

    max_delivery_attempts: int | None = 16
    fifo: bool = False
    dead_letter: bool = True
    dead_letter_topic: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HalfMessage:
    """A transactional half message waiting for commit or rollback."""

    transaction_id: str
    message_id: str
    message: Message
    queues: tuple[QueueRef, ...]
    store_timestamp_ms: int
    producer_group: str | None = None
