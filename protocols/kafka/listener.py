"""The Kafka listener: a TCP server whose connections share one :class:`KafkaServices`."""

from __future__ import annotations

import asyncio

from polymq.gateway.listeners import Listener, ListenerContext, TcpListener
from polymq.protocols.kafka.connection import serve_connection
from polymq.protocols.kafka.session import KafkaServices

__all__ = ["KafkaListener", "kafka_listener"]


class KafkaListener(TcpListener):
    """A :class:`TcpListener` plus the services its connections share, which
    stops with it (the group coordinator's timers)."""

    def __init__(self, context: ListenerContext) -> None:
        self.services = KafkaServices(context)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve_connection(self.services, reader, writer)

        super().__init__(
            name=context.name,
            host=context.host,
            port=context.port,
            handler=handle,
            connections=context.connections,
            protocol="kafka",
            # Open mode: the first whole request; SASL: a successful authentication.
            handshake_timeout_s=context.config.limits.handshake_timeout_ms / 1000,
        )

    async def stop(self) -> None:
        await super().stop()
        await self.services.close()


def kafka_listener(context: ListenerContext) -> Listener:
    return KafkaListener(context)
