"""The storage API: the one interface every protocol reaches storage through (via the
gateway's processor), implemented by the embedded engine and, remotely, by the
cluster client.

Every argument and result is plain data from :mod:`storage.model` (or builtins), so
the same calls can cross a network unchanged. Errors are the typed classes of
:mod:`storage.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from polymq.storage.errors import InvalidArgument
from polymq.storage.model import (
    AppendRequest,
    AppendResult,
    BatchEntry,
    CommittedOffset,
    GroupConfig,
    HalfMessage,
    Message,
    QueueOffsets,
    QueueRef,
    ReadResult,
    StoredBatch,
    StoredMessage,
    TopicConfig,
    TopicInfo,
)
from polymq.storage.names import check_name

__all__ = [
    "DEFAULT_INVISIBLE_MS",
    "DEFAULT_POP_MAX_MESSAGES",
    "DEFAULT_READ_MAX_BYTES",
    "DEFAULT_READ_MAX_MESSAGES",
    "DEFAULT_TOPIC_CONFIG",
    "DEFAULT_WAIT_MS",
    "StorageAPI",
    "check_append_queues",
    "check_invisible_ms",
    "check_pop",
]

# The defaults of the storage calls, named once so that every implementation and the
# processor above them agree: a caller that leaves an argument out gets the same
# behaviour whichever storage it reaches. Protocols pass their own values where their
# specification sets one.

DEFAULT_TOPIC_CONFIG = TopicConfig()
DEFAULT_READ_MAX_MESSAGES = 32
DEFAULT_READ_MAX_BYTES = 1 << 20  # a read still returns one message bigger than this
DEFAULT_WAIT_MS = 0  # no long poll unless asked for
DEFAULT_POP_MAX_MESSAGES = 1
DEFAULT_INVISIBLE_MS = 30_000  # a popped message not acked by then is handed out again


# The argument checks every implementation makes before it touches a node or a file,
# written once so that a bad call fails with the same error in either form.


def check_invisible_ms(invisible_ms: int) -> None:
    if invisible_ms < 0:
        raise InvalidArgument("invisible_ms must not be negative")


def check_pop(group: str, queues: Sequence[QueueRef], max_messages: int, invisible_ms: int) -> None:
    check_name("group", group)
    if max_messages < 1:
        raise InvalidArgument("max_messages must be at least 1")
    check_invisible_ms(invisible_ms)
    if not queues:
        raise InvalidArgument("pop needs at least one queue")


def check_append_queues(request: AppendRequest) -> None:
    if not request.queues:
        raise InvalidArgument("an append needs at least one queue")


@runtime_checkable
class StorageAPI(Protocol):
    """Durable topics, queues, cursors and metadata.

    Guarantees shared by every implementation:

    * An append, ack, offset commit or metadata change that returned has survived a
      crash of the process (``sync`` durability: also of the machine, unless the
      append said ``durable=False``).
    * Offsets in a queue are dense and start at 0; a message becomes readable once
      it is durable, so a reader never sees a message that a crash takes back (a
      ``durable=False`` message, or any with the engine's ``visible_before_fsync``:
      once written, so only a crash of the machine can take it back, with
      everything after it).
    * Long polls (``wait_ms``) return as soon as data is there, or empty at the end.
    """

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    # -- namespaces ----------------------------------------------------------------

    async def create_namespace(self, namespace: str) -> None: ...

    async def delete_namespace(self, namespace: str) -> None:
        """Delete an empty namespace (no topics)."""
        ...

    async def list_namespaces(self) -> list[str]: ...

    # -- topics and queues ---------------------------------------------------------

    async def create_topic(
        self, namespace: str, topic: str, config: TopicConfig = DEFAULT_TOPIC_CONFIG
    ) -> TopicInfo: ...

    async def alter_topic(self, namespace: str, topic: str, config: TopicConfig) -> TopicInfo:
        """Replace a topic's config; ``queue_count`` may only grow (Kafka's rule:
        shrinking would drop data)."""
        ...

    async def delete_topic(self, namespace: str, topic: str) -> None: ...

    async def list_topics(
        self, namespace: str, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        """The namespace's topics, without ``TopicConfig.internal`` ones unless
        ``include_internal``."""
        ...

    async def describe_topic(self, namespace: str, topic: str) -> TopicInfo: ...

    async def queue_offsets(self, queue: QueueRef) -> QueueOffsets: ...

    async def delete_records(self, queue: QueueRef, before_offset: int) -> QueueOffsets:
        """Move the queue's earliest offset up to ``before_offset`` (Kafka's
        DeleteRecords, an AMQP queue dropping consumed messages): earlier messages are
        no longer readable, and their space is reclaimed with their segments."""
        ...

    async def offset_for_timestamp(self, queue: QueueRef, timestamp_ms: int) -> int:
        """The first offset stored at or after ``timestamp_ms``; ``latest`` if none."""
        ...

    async def compact(
        self,
        queue: QueueRef,
        drop: Sequence[int] = (),
        rewrite: Mapping[int, BatchEntry] | None = None,
    ) -> int:
        """Remove records from the middle of a queue (Kafka's log compaction): each
        offset in ``drop`` becomes a gap, which reads, batch reads and pops skip (as
        Kafka consumers skip the offsets its cleaner removed); ``rewrite`` maps the
        first offset of a stored entry to a replacement spanning the same offsets (a
        Kafka batch re-encoded with only its kept records, same base offset and offset
        deltas; its ``messages``, if given, one per offset, the dropped ones' never
        read). An entry's offsets are dropped all together unless it is rewritten.
        Offsets stay as they are: ``queue_offsets`` is unchanged, and a gap is never
        reused; a long poll from gaps with nothing after them waits as at the end.
        Offsets below the queue's start are ignored; one at or past its end is
        ``InvalidArgument``. Returns how many offsets became gaps (new ones only).

        Atomic across crashes: after a crash the queue is either as before or fully
        compacted, never lost. Kept records may be copied (the engine rewrites the
        queue from the first changed offset), so the space of removed ones is
        reclaimed with their segments."""
        ...

    # -- append --------------------------------------------------------------------

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        """Store each request's entry once and index it into each of its queues.

        All requests of one call share one group commit. A message with a future
        ``delivery_time_ms`` gets its offsets when it becomes visible. The call
        returns once every request is durable, or only written when no request of
        the call asked for durability (``AppendRequest.durable``); such a message is
        readable once written."""
        ...

    async def cancel_delayed(self, namespace: str, message_id: str) -> bool:
        """Recall a delayed message not yet visible. False if none is pending."""
        ...

    # -- reads (offset mode) -------------------------------------------------------

    async def read(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = DEFAULT_READ_MAX_MESSAGES,
        max_bytes: int = DEFAULT_READ_MAX_BYTES,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> ReadResult:
        """Messages from ``offset`` on, one per offset (batch entries expanded).
        Returns at least one message if any is there, even over ``max_bytes``."""
        ...

    async def read_batches(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_bytes: int = DEFAULT_READ_MAX_BYTES,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> list[StoredBatch]:
        """Stored entries from the one holding ``offset`` on, as stored: a batch entry
        comes back with its ``raw`` bytes and ``base_offset`` (which may be below
        ``offset``, as a Kafka fetch returns the whole batch)."""
        ...

    async def commit_offset(
        self, namespace: str, group: str, queue: QueueRef, offset: int, metadata: str = ""
    ) -> None: ...

    async def fetch_offset(
        self, namespace: str, group: str, queue: QueueRef
    ) -> CommittedOffset | None: ...

    async def list_group_offsets(
        self, namespace: str, group: str
    ) -> dict[QueueRef, CommittedOffset]: ...

    async def delete_group_offsets(
        self, namespace: str, group: str, queues: Sequence[QueueRef] | None = None
    ) -> None: ...

    async def list_groups(self, namespace: str) -> list[str]:
        """Groups with committed offsets, pop state or a config."""
        ...

    # -- pop mode (queue semantics) ------------------------------------------------

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None: ...

    async def get_group_config(self, namespace: str, group: str) -> GroupConfig: ...

    async def pop(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int = DEFAULT_POP_MAX_MESSAGES,
        invisible_ms: int = DEFAULT_INVISIBLE_MS,
        wait_ms: int = DEFAULT_WAIT_MS,
        tags: frozenset[str] | None = None,
        durable: bool = True,
    ) -> list[StoredMessage]:
        """Hand out up to ``max_messages`` visible messages, each invisible to the
        group for ``invisible_ms`` unless acked. Redeliveries come first. Messages
        whose tag is not in ``tags`` (when given) are consumed silently for this
        group, as RocketMQ's tag filter does.

        ``durable=False`` returns once the hand-outs are written, before they are
        durable (they are with the next group commit): a crash of the machine may then
        forget them, so a message comes back visible at once without this delivery
        counted (for a consumer that acks at once anyway: AMQP no-ack).

        A pop cancelled after it handed messages out (while it waits for their
        durability) gives them back: visible again at once, the delivery not counted.
        A caller may cancel a pop at any time without losing or delaying messages."""
        ...

    async def ack(self, namespace: str, group: str, receipt: str, *, durable: bool = True) -> None:
        """Remove a popped message for the group. Raises ``InvalidReceipt`` if the
        receipt is stale (acked already, or handed out again since).

        ``durable=False`` (an ack nobody is answered for, as AMQP's ``basic.ack``)
        returns once the ack is written: fsynced with the next group commit that
        needs one or within the flush interval, so a crash of the machine before that
        may deliver the message again (at least once still holds)."""
        ...

    async def ack_many(
        self, namespace: str, group: str, receipts: Sequence[str], *, durable: bool = True
    ) -> list[str | None]:
        """Ack several messages with one durable write (RocketMQ's batch AckMessage,
        MNS BatchDeleteMessage, AMQP ``multiple``). Per receipt: ``None`` when acked,
        else the error code (``InvalidReceipt.code``) of why not. ``durable``: as
        for :meth:`ack`."""
        ...

    async def change_invisibility(
        self, namespace: str, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        """Make a popped message visible again ``invisible_ms`` from now (0: now, a
        nack). Returns it with its new receipt; the old receipt becomes stale."""
        ...

    async def nack(self, namespace: str, group: str, receipt: str, *, delay_ms: int = 0) -> None:
        """Give a popped message back: visible again after ``delay_ms`` (AMQP
        ``basic.nack`` with requeue, RocketMQ's retry backoff). The next delivery counts
        as a new attempt."""
        ...

    async def give_back(self, namespace: str, group: str, receipts: Sequence[str]) -> None:
        """Undo the pops that handed these out: nobody got them (a pop answered after
        its caller stopped waiting). Each is visible again at once, with the delivery
        attempt it had before that pop, as the engine's own cancelled pop leaves it;
        unlike :meth:`nack`, the next delivery is not a new attempt, so no message is
        dead-lettered early for a hand-out nobody saw. A receipt acked or handed out
        again since is skipped."""
        ...

    async def dead_letter(self, namespace: str, group: str, receipt: str) -> None:
        """Move a popped message to the group's dead-letter topic now (RocketMQ's
        ForwardMessageToDeadLetterQueue); it is consumed for the group."""
        ...

    async def inflight_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        """Messages handed out to the group and not yet acked."""
        ...

    async def pending_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        """Messages of the queue not yet acked by the group (visible or not)."""
        ...

    async def consumed_below(self, namespace: str, group: str, queue: QueueRef) -> int:
        """The group's fully acked prefix of the queue: every offset below it is
        consumed (the queue's earliest offset if the group never popped there). Where
        a queue's one consumer group is all that reads it (an MNS queue), records below
        this may be deleted."""
        ...

    async def delayed_count(self, namespace: str, queue: QueueRef) -> int:
        """Messages appended to the queue with a future delivery time, not yet due
        (they have no offset until then). Cancelled ones are not counted."""
        ...

    # -- transactions --------------------------------------------------------------

    async def append_half(
        self, request: AppendRequest, *, producer_group: str | None = None
    ) -> HalfMessage:
        """Store a transactional half message: durable, invisible until commit."""
        ...

    async def end_transaction(
        self, namespace: str, transaction_id: str, *, commit: bool
    ) -> AppendResult | None:
        """Commit (the message gets offsets, as an append) or roll back (``None``)."""
        ...

    async def list_undecided(
        self, namespace: str | None = None, *, older_than_ms: int = 0
    ) -> list[HalfMessage]: ...

    # -- keyed latest value (MQTT retained, compaction) ----------------------------

    async def put_latest(
        self, namespace: str, topic: str, key: bytes, message: Message | None
    ) -> None:
        """Set (or with ``None`` clear) the latest message for ``key`` in ``topic``.
        Topic here is any name: it need not be a created topic."""
        ...

    async def get_latest(self, namespace: str, topic: str, key: bytes) -> Message | None: ...

    async def list_latest(self, namespace: str, topic: str) -> list[tuple[bytes, Message]]: ...

    # -- metadata for protocols (exchanges, bindings, sessions, accounts) ----------

    async def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        """Durably store a JSON-compatible value under (namespace, kind, name)."""
        ...

    async def meta_get(self, namespace: str, kind: str, name: str) -> Any | None: ...

    async def meta_delete(self, namespace: str, kind: str, name: str) -> bool: ...

    async def meta_list(self, namespace: str, kind: str) -> dict[str, Any]: ...
