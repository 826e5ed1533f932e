"""Clients known by their Telemetry stream: one session per client id.

A session is what the gateway knows of a connected client (its settings: type,
group, published topics, subscriptions) and the way to reach it (the stream's
outbox, for transaction check-backs and diagnostics). Each session is one entry in
the gateway's connection registry, so the admin view counts RocketMQ clients.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from polymq.gateway.connections import ConnectionRegistry
from polymq.gateway.processor import Caller
from polymq.protocols.rocketmq.filters import MATCH_ALL, Filter

__all__ = ["ClientSession", "Sessions"]

log = logging.getLogger(__name__)

# rocketmq.grpc_protocol ClientType values (kept numeric to stay free of protobuf here).
PRODUCER = 1
PUSH_CONSUMER = 2
SIMPLE_CONSUMER = 3


@dataclass(slots=True, kw_only=True)
class ClientSession:
    client_id: str
    caller: Caller
    peer: str = ""
    connection_id: int | None = None
    client_type: int = 0
    group: str | None = None
    topics: set[str] = field(default_factory=set)
    subscriptions: dict[str, Filter] = field(default_factory=dict)
    fifo: bool = False
    outbox: asyncio.Queue[Any | None] = field(default_factory=asyncio.Queue)
    replies: dict[str, asyncio.Future[Any]] = field(default_factory=dict)

    def send(self, command: Any) -> None:
        """Queue a TelemetryCommand for the client."""
        self.outbox.put_nowait(command)

    def end(self) -> None:
        """End the stream (a kick, a replaced stream, shutdown)."""
        self.outbox.put_nowait(None)

    def subscription(self, topic: str) -> Filter:
        return self.subscriptions.get(topic, MATCH_ALL)


class Sessions:
    def __init__(self, connections: ConnectionRegistry) -> None:
        self._connections = connections
        self._by_client: dict[str, ClientSession] = {}
        self._rotation = itertools.count()

    def __iter__(self) -> Iterator[ClientSession]:
        return iter(list(self._by_client.values()))

    def get(self, client_id: str) -> ClientSession | None:
        return self._by_client.get(client_id)

    def open(self, client_id: str, caller: Caller, peer: str) -> ClientSession:
        """Register the client's stream; a stream it opened before is ended (the
        clients rebuild their stream on errors). Raises ``TooManyConnections``."""
        old = self._by_client.pop(client_id, None)
        if old is not None:
            self._release(old)
        session = ClientSession(client_id=client_id, caller=caller, peer=peer)

        async def close() -> None:
            session.end()

        conn = self._connections.register(
            protocol=caller.protocol,
            peer=peer,
            close=close,
            principal=caller.principal,
            namespace=caller.namespace,
            client_id=client_id,
        )
        session.connection_id = conn.id
        self._by_client[client_id] = session
        return session

    def close(self, session: ClientSession) -> None:
        if self._by_client.get(session.client_id) is session:
            del self._by_client[session.client_id]
        self._release(session)

    def _release(self, session: ClientSession) -> None:
        if session.connection_id is not None:
            self._connections.unregister(session.connection_id)
            session.connection_id = None
        session.end()
        for reply in session.replies.values():
            if not reply.done():
                reply.cancel()

    def close_all(self) -> None:
        for session in list(self._by_client.values()):
            self.close(session)

    def producer_for(self, namespace: str, topic: str) -> ClientSession | None:
        """A producer that can settle a transaction of ``topic``: one that declared
        the topic, else any producer of the namespace (as Apache's proxy asks any
        producer of the transaction's group), picked in rotation."""
        producers = [
            s
            for s in self._by_client.values()
            if s.client_type == PRODUCER and s.caller.namespace == namespace
        ]
        declared = [s for s in producers if topic in s.topics]
        candidates = declared or producers
        if not candidates:
            return None
        return candidates[next(self._rotation) % len(candidates)]
