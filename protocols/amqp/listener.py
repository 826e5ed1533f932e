"""The AMQP 0-9-1 listeners: TCP servers whose connections speak AMQP, plaintext
(``amqp``, 5672) and AMQPS (``amqps``, 5671), sharing one gateway's vhosts."""

from __future__ import annotations

import asyncio
import weakref

from polymq.gateway.listeners import GatewayTcpListener, Listener, ListenerContext
from polymq.gateway.processor import Processor
from polymq.protocols.amqp.changes import Membership
from polymq.protocols.amqp.connection import AmqpConnection
from polymq.protocols.amqp.flow import FlowControl
from polymq.protocols.amqp.natural import NaturalTopics
from polymq.protocols.amqp.vhost import AmqpServices

__all__ = ["AmqpListener", "amqp_listener"]

# The vhosts (consumers, exclusive queues, membership among gateways) are one
# gateway's, whichever listener a connection came in on: AMQP and AMQPS share them,
# and the last of the two to stop closes them.
_SHARED: weakref.WeakKeyDictionary[Processor, tuple[AmqpServices, set[str]]] = (
    weakref.WeakKeyDictionary()
)


def _services_for(context: ListenerContext) -> AmqpServices:
    shared = _SHARED.get(context.processor)
    if shared is None:
        gateway_id = context.config.cluster.gateway_id or context.directory.self_id
        # Membership follows the first listener's endpoints (the plaintext one when
        # both serve: the same gateways either way).
        membership = Membership(context.directory, context.name, gateway_id)
        amqp = context.config.amqp
        natural = NaturalTopics(amqp.natural_topics, tuple(amqp.natural_topics_exclude))
        shared = (AmqpServices(context.processor, membership, natural), set())
        _SHARED[context.processor] = shared
    shared[1].add(context.name)
    return shared[0]


class AmqpListener(GatewayTcpListener):
    """A :class:`GatewayTcpListener` whose stop also ends the vhosts' background work
    (``x-expires`` timers, TTL sweepers). ``flow`` is its publishing alarm
    (:class:`FlowControl`): whatever watches a resource engages and releases it."""

    def __init__(self, context: ListenerContext, *, flow: FlowControl | None = None) -> None:
        self._services = _services_for(context)
        self._processor = context.processor
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
            shared = _SHARED.get(self._processor)
            if shared is not None and shared[0] is self._services:
                shared[1].discard(self._name)
                if not shared[1]:
                    del _SHARED[self._processor]
                    await self._services.close()
            else:
                await self._services.close()


def amqp_listener(context: ListenerContext) -> Listener:
    return AmqpListener(context)
