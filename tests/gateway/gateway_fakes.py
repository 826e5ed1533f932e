"""An in-memory stand-in for the few StorageAPI calls the gateway tests reach.

It stands for storage, never for the gateway code under test; the real engine
replaces it wherever a test needs real storage behaviour.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from gateway.listeners import ListenerContext, TcpListener
from storage import api
from storage.errors import NamespaceAlreadyExists, NamespaceNotFound, TopicNotFound
from storage.model import (
    AppendRequest,
    AppendResult,
    BatchEntry,
    Message,
    Placement,
    QueueOffsets,
    QueueRef,
    ReadResult,
    StoredMessage,
    TopicConfig,
    TopicInfo,
)


class MemoryStorage:
    def __init__(self) -> None:
        self.started = False
        self.closed = False
        self.namespaces: set[str] = set()
        self.topics: dict[tuple[str, str], TopicConfig] = {}
        self.queues: dict[QueueRef, list[StoredMessage]] = {}
        self._ids = itertools.count(1)
        self.dedup: dict[tuple[str, str], AppendResult] = {}
        self.pop_durable: bool | None = None

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        # Any other StorageAPI method: fails the test if it is actually called.
        async def unexpected(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"MemoryStorage.{name} is not faked, yet was called")

        return unexpected

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def create_namespace(self, namespace: str) -> None:
        if namespace in self.namespaces:
            raise NamespaceAlreadyExists(namespace)
        self.namespaces.add(namespace)

    async def delete_namespace(self, namespace: str) -> None:
        self.namespaces.discard(namespace)

    async def list_namespaces(self) -> list[str]:
        return sorted(self.namespaces)

    async def create_topic(
        self, namespace: str, topic: str, config: TopicConfig = api.DEFAULT_TOPIC_CONFIG
    ) -> TopicInfo:
        if namespace not in self.namespaces:
            raise NamespaceNotFound(namespace)
        self.topics[(namespace, topic)] = config
        return TopicInfo(namespace=namespace, name=topic, config=config)

    async def list_topics(
        self, namespace: str, *, include_internal: bool = False
    ) -> list[TopicInfo]:
        return [
            TopicInfo(namespace=ns, name=name, config=config)
            for (ns, name), config in sorted(self.topics.items())
            if ns == namespace and (include_internal or not config.internal)
        ]

    async def append(self, requests: Sequence[AppendRequest]) -> list[AppendResult]:
        results = []
        for request in requests:
            key = (request.queues[0].namespace, request.dedup_key or "")
            if request.dedup_key is not None and key in self.dedup:
                results.append(replace(self.dedup[key], duplicate=True))
                continue
            entry = request.entry
            messages = entry.messages if isinstance(entry, BatchEntry) else (entry,)
            message_id = f"m{next(self._ids)}"
            placements = []
            for queue in request.queues:
                if (queue.namespace, queue.topic) not in self.topics:
                    raise TopicNotFound(str(queue))
                log = self.queues.setdefault(queue, [])
                placements.append(Placement(queue, len(log)))
                for message in messages:
                    log.append(_stored(message, queue, len(log), message_id))
            results.append(
                AppendResult(
                    message_id=message_id, store_timestamp_ms=0, placements=tuple(placements)
                )
            )
            if request.dedup_key is not None:
                self.dedup[key] = results[-1]
        return results

    async def read(
        self,
        queue: QueueRef,
        offset: int,
        *,
        max_messages: int = api.DEFAULT_READ_MAX_MESSAGES,
        max_bytes: int = api.DEFAULT_READ_MAX_BYTES,
        wait_ms: int = api.DEFAULT_WAIT_MS,
    ) -> ReadResult:
        log = self.queues.get(queue, [])
        messages = tuple(log[offset : offset + max_messages])
        return ReadResult(
            messages=messages,
            next_offset=offset + len(messages),
            offsets=QueueOffsets(0, len(log)),
        )

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
        self.pop_durable = durable
        popped: list[StoredMessage] = []
        for queue in queues:
            log = self.queues.get(queue, [])
            while log and len(popped) < max_messages:
                popped.append(log.pop(0))
        return popped


def _stored(message: Message, queue: QueueRef, offset: int, message_id: str) -> StoredMessage:
    return StoredMessage(
        message=message, queue=queue, offset=offset, message_id=message_id, store_timestamp_ms=0
    )


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo lines back; a protocol handler small enough to see the transport work."""
    while line := await reader.readline():
        writer.write(line)
        await writer.drain()


def echo_listener(context: ListenerContext) -> TcpListener:
    """A listener factory as protocols provide them, serving :func:`echo`."""
    return TcpListener(
        name=context.name,
        host=context.host,
        port=context.port,
        handler=echo,
        connections=context.connections,
    )
