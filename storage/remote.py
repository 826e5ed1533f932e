"""The storage API of one storage node, over the network (the node's side is
:mod:`storage.node`).

Every method forwards as is, over one pipelined connection: concurrent calls share
it, a long poll holds up nothing behind it, and cancelling a call (a pop whose
consumer went away) cancels it on the node, where the engine gives any handed-out
messages back. Appends made in one loop iteration go as one call
(:mod:`storage.remote_appends`): each call costs both processes about as much CPU as
the engine's work on a message. A node that cannot be reached raises
``StorageUnavailable``; the next call tries again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from functools import partial
from ssl import SSLContext
from typing import Any, cast

from polymq.storage import api
from polymq.storage.errors import StorageError
from polymq.storage.lifecycle import TaskSet
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
from polymq.storage.remote_appends import AppendBatcher
from polymq.storage.routes import NodeHeartbeat
from polymq.storage.rpc import RpcClient

__all__ = ["MERGE_APPENDS", "RemoteStorage"]

# Appends made in one loop iteration sent as one call (storage/remote_appends.py).
MERGE_APPENDS = True


class RemoteStorage:
    """:class:`~storage.api.StorageAPI` over the storage node at ``host:port``, plus
    the node's own calls (:meth:`claim_home`, :meth:`node_info`)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout: float = 5.0,
        ssl: SSLContext | None = None,
        merge_appends: bool | None = None,
    ) -> None:
        # ``ssl``: TLS to the node (``[tls] internal``), mutual with a client certificate.
        self._rpc = RpcClient(host, port, connect_timeout=connect_timeout, ssl=ssl)
        self._giving_back = TaskSet(f"the storage client of {host}:{port}")
        # ``merge_appends``: False sends every append as its own call (default:
        # MERGE_APPENDS), for side-by-side figures (bench/workers.py --merge-appends).
        merge = MERGE_APPENDS if merge_appends is None else merge_appends
        self.appends = AppendBatcher(self._send_append) if merge else None

    @property
    def target(self) -> str:
        """``host:port`` of the node, for messages."""
        return self._rpc.target

    # -- lifecycle: the connection opens on the first call -----------------------------

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await self._giving_back.close()
        await self._rpc.close()

    # -- the node's own calls ------------------------------------------------------

    async def claim_home(self, namespace: str) -> None:
        """Make the node the home of ``namespace``'s namespace-wide data (creating the
        namespace there if needed); it reports the claim to nameservers from now on,
        and after restarts."""
        await self._rpc.call("claim_home", namespace)

    async def node_info(self) -> NodeHeartbeat:
        """What the node tells nameservers right now."""
        return cast(NodeHeartbeat, await self._rpc.call("node_info"))

    # -- namespaces ----------------------------------------------------------------

    async def create_namespace(self, namespace: str) -> None:
        await self._rpc.call("create_namespace", namespace)

    async def delete_namespace(self, namespace: str) -> None:
        await self._rpc.call("delete_namespace", namespace)

    async def list_namespaces(self) -> list[str]:
        return cast(list[str], await self._rpc.call("list_namespaces"))

    # -- topics and queues ---------------------------------------------------------

    async def create_topic(
        self, namespace: str, topic: str, config: TopicConfig = api.DEFAULT_TOPIC_CONFIG
    ) -> TopicInfo:
        return cast(TopicInfo, await self._rpc.call("create_topic", namespace, topic, config))

    async def alter_topic(self, namespace: str, topic: str, config: TopicConfig) -> TopicInfo:
        return cast(TopicInfo, await self._rpc.call("alter_topic", namespace, topic, config))

    async def delete_topic(self, namespace: str, topic: str) -> None:
        await self._rpc.call("delete_topic", namespace, topic)

    async def list_topics(
        self, namespace: str, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        return cast(
            list[TopicInfo],
            await self._rpc.call("list_topics", namespace, include_internal=include_internal),
        )

    async def describe_topic(self, namespace: str, topic: str) -> TopicInfo:
        return cast(TopicInfo, await self._rpc.call("describe_topic", namespace, topic))

    async def queue_offsets(self, queue: QueueRef) -> QueueOffsets:
        return cast(QueueOffsets, await self._rpc.call("queue_offsets", queue))

    async def delete_records(self, queue: QueueRef, before_offset: int) -> QueueOffsets:
        return cast(QueueOffsets, await self._rpc.call("delete_records", queue, before_offset))

    async def offset_for_timestamp(self, queue: QueueRef, timestamp_ms: int) -> int:
        return cast(int, await self._rpc.call("offset_for_timestamp", queue, timestamp_ms))

    async def compact(
        self,
        queue: QueueRef,
        drop: Sequence[int] = (),
        rewrite: Mapping[int, BatchEntry] | None = None,
    ) -> int:
        return cast(
            int,
            await self._rpc.call(
                "compact", queue, list(drop), None if rewrite is None else dict(rewrite)
            ),
        )

    # -- append --------------------------------------------------------------------

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        if self.appends is None:
            return await self._send_append(list(requests))
        return await self.appends.append(requests)

    async def _send_append(self, requests: list[AppendRequest]) -> list[AppendResult]:
        return cast(list[AppendResult], await self._rpc.call("append", requests))

    async def cancel_delayed(self, namespace: str, message_id: str) -> bool:
        return cast(bool, await self._rpc.call("cancel_delayed", namespace, message_id))

    # -- reads (offset mode) -------------------------------------------------------

    async def read(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = api.DEFAULT_READ_MAX_MESSAGES,
        max_bytes: int = api.DEFAULT_READ_MAX_BYTES,
        wait_ms: int = api.DEFAULT_WAIT_MS,
    ) -> ReadResult:
        return cast(
            ReadResult,
            await self._rpc.call(
                "read",
                queue,
                offset,
                max_messages=max_messages,
                max_bytes=max_bytes,
                wait_ms=wait_ms,
            ),
        )

    async def read_batches(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_bytes: int = api.DEFAULT_READ_MAX_BYTES,
        wait_ms: int = api.DEFAULT_WAIT_MS,
    ) -> list[StoredBatch]:
        return cast(
            list[StoredBatch],
            await self._rpc.call(
                "read_batches", queue, offset, max_bytes=max_bytes, wait_ms=wait_ms
            ),
        )

    async def commit_offset(
        self, namespace: str, group: str, queue: QueueRef, offset: int, metadata: str = ""
    ) -> None:
        await self._rpc.call("commit_offset", namespace, group, queue, offset, metadata)

    async def fetch_offset(
        self, namespace: str, group: str, queue: QueueRef
    ) -> CommittedOffset | None:
        return cast(
            CommittedOffset | None, await self._rpc.call("fetch_offset", namespace, group, queue)
        )

    async def list_group_offsets(
        self, namespace: str, group: str
    ) -> dict[QueueRef, CommittedOffset]:
        return cast(
            dict[QueueRef, CommittedOffset],
            await self._rpc.call("list_group_offsets", namespace, group),
        )

    async def delete_group_offsets(
        self, namespace: str, group: str, queues: Sequence[QueueRef] | None = None
    ) -> None:
        await self._rpc.call(
            "delete_group_offsets", namespace, group, None if queues is None else list(queues)
        )

    async def list_groups(self, namespace: str) -> list[str]:
        return cast(list[str], await self._rpc.call("list_groups", namespace))

    # -- pop mode (queue semantics) ------------------------------------------------

    async def set_group_config(self, namespace: str, group: str, config: GroupConfig) -> None:
        await self._rpc.call("set_group_config", namespace, group, config)

    async def get_group_config(self, namespace: str, group: str) -> GroupConfig:
        return cast(GroupConfig, await self._rpc.call("get_group_config", namespace, group))

    async def pop(
        self,
        namespace: str,
        group: str,
        queues: Sequence[QueueRef],
        *,
        max_messages: int = api.DEFAULT_POP_MAX_MESSAGES,
        invisible_ms: int = api.DEFAULT_INVISIBLE_MS,
        wait_ms: int = api.DEFAULT_WAIT_MS,
        tags: frozenset[str] | None = None,
        durable: bool = True,
    ) -> list[StoredMessage]:
        return cast(
            list[StoredMessage],
            await self._rpc.call_undoable(
                partial(self._give_back, namespace, group),
                "pop",
                namespace,
                group,
                list(queues),
                max_messages=max_messages,
                invisible_ms=invisible_ms,
                wait_ms=wait_ms,
                tags=None if tags is None else frozenset(tags),
                durable=durable,
            ),
        )

    def _give_back(self, namespace: str, group: str, popped: list[StoredMessage]) -> None:
        """A pop the node answered after its caller stopped waiting (a consumer that
        left while its long poll was being answered): those messages go back now, as
        the node's own cancelled pop gives its messages back, instead of waiting
        out their invisibility and arriving behind later ones."""
        receipts = [m.receipt for m in popped if m.receipt is not None]
        if receipts and not self._giving_back.closed:
            self._giving_back.spawn(self._give_back_quietly(namespace, group, receipts))

    async def _give_back_quietly(self, namespace: str, group: str, receipts: list[str]) -> None:
        with contextlib.suppress(StorageError):  # the node gone: their leases run out
            await self.give_back(namespace, group, receipts)

    async def give_back(self, namespace: str, group: str, receipts: Sequence[str]) -> None:
        await self._rpc.call("give_back", namespace, group, list(receipts))

    async def ack(self, namespace: str, group: str, receipt: str, *, durable: bool = True) -> None:
        await self._rpc.call("ack", namespace, group, receipt, durable=durable)

    async def ack_many(
        self, namespace: str, group: str, receipts: Sequence[str], *, durable: bool = True
    ) -> list[str | None]:
        return cast(
            list[str | None],
            await self._rpc.call("ack_many", namespace, group, list(receipts), durable=durable),
        )

    async def change_invisibility(
        self, namespace: str, group: str, receipt: str, invisible_ms: int
    ) -> StoredMessage:
        return cast(
            StoredMessage,
            await self._rpc.call("change_invisibility", namespace, group, receipt, invisible_ms),
        )

    async def nack(self, namespace: str, group: str, receipt: str, *, delay_ms: int = 0) -> None:
        await self._rpc.call("nack", namespace, group, receipt, delay_ms=delay_ms)

    async def dead_letter(self, namespace: str, group: str, receipt: str) -> None:
        await self._rpc.call("dead_letter", namespace, group, receipt)

    async def inflight_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return cast(int, await self._rpc.call("inflight_count", namespace, group, queue))

    async def pending_count(self, namespace: str, group: str, queue: QueueRef) -> int:
        return cast(int, await self._rpc.call("pending_count", namespace, group, queue))

    async def consumed_below(self, namespace: str, group: str, queue: QueueRef) -> int:
        return cast(int, await self._rpc.call("consumed_below", namespace, group, queue))

    async def delayed_count(self, namespace: str, queue: QueueRef) -> int:
        return cast(int, await self._rpc.call("delayed_count", namespace, queue))

    # -- transactions --------------------------------------------------------------

    async def append_half(
        self, request: AppendRequest, *, producer_group: str | None = None
    ) -> HalfMessage:
        return cast(
            HalfMessage,
            await self._rpc.call("append_half", request, producer_group=producer_group),
        )

    async def end_transaction(
        self, namespace: str, transaction_id: str, *, commit: bool
    ) -> AppendResult | None:
        return cast(
            AppendResult | None,
            await self._rpc.call("end_transaction", namespace, transaction_id, commit=commit),
        )

    async def list_undecided(
        self, namespace: str | None = None, *, older_than_ms: int = 0
    ) -> list[HalfMessage]:
        return cast(
            list[HalfMessage],
            await self._rpc.call("list_undecided", namespace, older_than_ms=older_than_ms),
        )

    # -- keyed latest value --------------------------------------------------------

    async def put_latest(
        self, namespace: str, topic: str, key: bytes, message: Message | None
    ) -> None:
        await self._rpc.call("put_latest", namespace, topic, key, message)

    async def get_latest(self, namespace: str, topic: str, key: bytes) -> Message | None:
        return cast(Message | None, await self._rpc.call("get_latest", namespace, topic, key))

    async def list_latest(self, namespace: str, topic: str) -> list[tuple[bytes, Message]]:
        return cast(
            list[tuple[bytes, Message]], await self._rpc.call("list_latest", namespace, topic)
        )

    # -- metadata ------------------------------------------------------------------

    async def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        await self._rpc.call("meta_put", namespace, kind, name, value)

    async def meta_get(self, namespace: str, kind: str, name: str) -> Any | None:
        return await self._rpc.call("meta_get", namespace, kind, name)

    async def meta_delete(self, namespace: str, kind: str, name: str) -> bool:
        return cast(bool, await self._rpc.call("meta_delete", namespace, kind, name))

    async def meta_list(self, namespace: str, kind: str) -> dict[str, Any]:
        return cast(dict[str, Any], await self._rpc.call("meta_list", namespace, kind))
