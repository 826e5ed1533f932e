"""The Kafka listener: a TCP server whose connections share one broker state."""

from __future__ import annotations

import asyncio

from gateway.listeners import Listener, ListenerContext, TcpListener
from protocols.kafka.connection import serve_connection
from protocols.kafka.session import Broker

__all__ = ["KafkaListener", "kafka_listener"]


class KafkaListener:
    """A :class:`TcpListener` plus the broker state its connections share, which
    stops with it (the group coordinator's timers)."""

    def __init__(self, context: ListenerContext) -> None:
        self.broker = Broker(context)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve_connection(self.broker, reader, writer)

        self._tcp = TcpListener(
            name=context.name,
            host=context.host,
            port=context.port,
            handler=handle,
            connections=context.connections,
            protocol="kafka",
        )

    @property
    def name(self) -> str:
        return self._tcp.name

    @property
    def port(self) -> int:
        return self._tcp.port

    @property
    def address(self) -> tuple[str, int] | None:
        return self._tcp.address

    async def start(self) -> None:
        await self._tcp.start()

    async def stop(self) -> None:
        await self._tcp.stop()
        await self.broker.close()


def kafka_listener(context: ListenerContext) -> Listener:
    return KafkaListener(context)
