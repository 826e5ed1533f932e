"""The AMQP 0-9-1 listener: a TCP server whose connections speak AMQP."""

from __future__ import annotations

import asyncio

from polymq.gateway.listeners import GatewayTcpListener, Listener, ListenerContext
from polymq.protocols.amqp.changes import Membership
from polymq.protocols.amqp.connection import AmqpConnection
from polymq.protocols.amqp.flow import FlowControl
from polymq.protocols.amqp.natural import NaturalTopics
from polymq.protocols.amqp.vhost import AmqpServices

__all__ = ["AmqpListener", "amqp_listener"]


class AmqpListener(GatewayTcpListener):
    """A :class:`GatewayTcpListener` whose stop also ends the vhosts' background work
    (``x-expires`` timers, TTL sweepers). ``flow`` is its publishing alarm
    (:class:`FlowControl`): whatever watches a resource engages and releases it."""

    def __init__(self, context: ListenerContext, *, flow: FlowControl | None = None) -> None:
        gateway_id = context.config.cluster.gateway_id or context.directory.self_id
        membership = Membership(context.directory, context.name, gateway_id)
        amqp = context.config.amqp
        natural = NaturalTopics(amqp.natural_topics, tuple(amqp.natural_topics_exclude))
        self._services = AmqpServices(context.processor, membership, natural)
        self.flow = flow or FlowControl()
        services, flow = self._services, self.flow

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await AmqpConnection(context, services, reader, writer, flow).run()

        # RabbitMQ's handshake_timeout: header to connection.open-ok (which identifies
        # the connection, marking it established) or the socket closes.
        super().__init__(context, handle, protocol="amqp")

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            await self._services.close()


def amqp_listener(context: ListenerContext) -> Listener:
    return AmqpListener(context)
