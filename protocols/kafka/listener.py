"""The Kafka listener: a TCP server whose connections share one :class:`KafkaServices`."""

from __future__ import annotations

import asyncio

from polymq.gateway.listeners import GatewayTcpListener, Listener, ListenerContext
from polymq.protocols.kafka.connection import serve_connection
from polymq.protocols.kafka.session import KafkaServices

__all__ = ["KafkaListener", "kafka_listener"]


class KafkaListener(GatewayTcpListener):
    """A :class:`GatewayTcpListener` plus the services its connections share, which
    stops with it (the group coordinator's timers)."""

    def __init__(self, context: ListenerContext) -> None:
        self.services = KafkaServices(context)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve_connection(self.services, reader, writer)

        # The handshake: in open mode the first whole request; with SASL, a successful
        # authentication.
        super().__init__(context, handle, protocol="kafka")

    async def stop(self) -> None:
        await super().stop()
        await self.services.close()


def kafka_listener(context: ListenerContext) -> Listener:
    return KafkaListener(context)
