"""The Kafka listeners: TCP servers whose connections share one :class:`KafkaServices`
per gateway, plaintext (``kafka``, 9092) and TLS (``kafka_tls``, 9093: Kafka's
``SSL`` and ``SASL_SSL`` on one port, SASL being optional on it as on the plaintext one)."""

from __future__ import annotations

import asyncio
import weakref

from polymq.gateway.listeners import (
    GatewayTcpListener,
    Listener,
    ListenerContext,
    peer_certificate_name,
)
from polymq.gateway.processor import Processor
from polymq.protocols.kafka.connection import serve_connection
from polymq.protocols.kafka.session import KafkaServices

__all__ = ["KafkaListener", "kafka_listener"]

# Group membership, transactions and producer state live in one gateway's memory, so
# the plaintext and the TLS listener of a gateway share them (a group's members may
# come over either); the last listener to stop closes them.
_SHARED: weakref.WeakKeyDictionary[Processor, tuple[KafkaServices, set[str]]] = (
    weakref.WeakKeyDictionary()
)


def _services_for(context: ListenerContext) -> KafkaServices:
    shared = _SHARED.get(context.processor)
    if shared is None:
        shared = _SHARED[context.processor] = (KafkaServices(context), set())
    shared[1].add(context.name)
    return shared[0]


class KafkaListener(GatewayTcpListener):
    """A :class:`GatewayTcpListener` plus the services its connections share, which
    stop with the gateway's last Kafka listener (the group coordinator's timers).

    Metadata and FindCoordinator name this listener's endpoints (the directory's
    entries under its name), so a client that came in over TLS is sent to TLS ports.
    With ``[tls] principal_from``, a verified client certificate authenticates the
    connection (Kafka's SSL principal), as the account its CN names."""

    def __init__(self, context: ListenerContext) -> None:
        self.services = _services_for(context)
        tls = context.tls

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve_connection(
                self.services,
                reader,
                writer,
                listener=context.name,
                certificate_name=peer_certificate_name(writer, tls),
            )

        # The handshake: in open mode the first whole request; with SASL, a successful
        # authentication (or, over TLS, a certificate naming the account).
        super().__init__(context, handle, protocol="kafka", own_port=_own_port(context))
        self._processor = context.processor

    async def stop(self) -> None:
        await super().stop()
        shared = _SHARED.get(self._processor)
        if shared is None or shared[0] is not self.services:
            await self.services.close()
            return
        shared[1].discard(self._name)
        if not shared[1]:
            del _SHARED[self._processor]
            await self.services.close()


def _own_port(context: ListenerContext) -> int | None:
    """A worker's own Kafka port (``polymq run --workers N``): clients reach every
    worker on the shared port, but Metadata and FindCoordinator must send a client to
    one worker (its group's coordinator, its partitions' leaders), so each also
    listens on a port of its own, which is what it advertises. ``None`` elsewhere."""
    workers = context.config.workers
    if not workers.worker:
        return None
    return {"kafka": workers.kafka_port, "kafka_tls": workers.kafka_tls_port}.get(context.name)


def kafka_listener(context: ListenerContext) -> Listener:
    return KafkaListener(context)
