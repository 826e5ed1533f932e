"""The exchange and queue classes' methods (spec sections 1.6, 1.7): declarations,
bindings, purge and delete, each answered on its channel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pamqp import commands

from polymq.gateway.permissions import Operation
from polymq.protocols.amqp import errors
from polymq.protocols.amqp.errors import ChannelError
from polymq.protocols.amqp.queues import json_safe
from polymq.protocols.amqp.routing import Binding

if TYPE_CHECKING:
    from polymq.protocols.amqp.channel import Channel

__all__ = [
    "exchange_bind",
    "exchange_declare",
    "exchange_delete",
    "queue_bind",
    "queue_declare",
    "queue_delete",
    "queue_purge",
]


_SERVER_NAMED = "amq.gen"

# -- exchange class --------------------------------------------------------------


async def _authorize(channel: Channel, name: str, operation: Operation) -> None:
    """RabbitMQ's configure/write/read as the permission model's operations on the
    exchange or queue's name (docs/permissions.md); a refusal is access-refused (403)
    through the channel's error mapping."""
    await channel.conn.processor.authorize(channel.conn.caller, "topic", name, operation)


async def exchange_declare(channel: Channel, method: commands.Exchange.Declare) -> None:
    await _authorize(channel, method.exchange, "describe" if method.passive else "create")
    await channel.conn.vhost.declare_exchange(
        channel.conn.caller,
        name=method.exchange,
        type=method.exchange_type,
        passive=method.passive,
        durable=method.durable,
        auto_delete=method.auto_delete,
        internal=method.internal,
        arguments=method.arguments or {},
    )
    if not method.nowait:
        channel.send(commands.Exchange.DeclareOk())


async def exchange_delete(channel: Channel, method: commands.Exchange.Delete) -> None:
    await _authorize(channel, method.exchange, "delete")
    await channel.conn.vhost.delete_exchange(
        channel.conn.caller, method.exchange, if_unused=method.if_unused
    )
    if not method.nowait:
        channel.send(commands.Exchange.DeleteOk())


async def exchange_bind(
    channel: Channel, method: commands.Exchange.Bind | commands.Exchange.Unbind
) -> None:
    binding = Binding(
        source=method.source,
        destination=method.destination,
        routing_key=method.routing_key,
        to_exchange=True,
        arguments=_binding_arguments(method.arguments),
    )
    unbind = isinstance(method, commands.Exchange.Unbind)
    await _authorize(channel, method.destination, "write")
    await _authorize(channel, method.source, "read")
    await channel.conn.vhost.bind(
        channel.conn.caller, binding, owner=channel.conn.key, unbind=unbind
    )
    if not method.nowait:
        channel.send(commands.Exchange.UnbindOk() if unbind else commands.Exchange.BindOk())


# -- queue class -----------------------------------------------------------------


async def queue_declare(channel: Channel, method: commands.Queue.Declare) -> None:
    vhost, caller = channel.conn.vhost, channel.conn.caller
    arguments = dict(method.arguments or {})
    if arguments.get("x-queue-type") not in (None, "classic", "quorum", "stream"):
        raise ChannelError(
            errors.PRECONDITION_FAILED,
            f"x-queue-type {arguments['x-queue-type']!r} is not supported",
        )
    # A server-named queue is checked as "amq.gen" (its name is not known yet).
    await _authorize(
        channel, method.queue or _SERVER_NAMED, "describe" if method.passive else "create"
    )
    queue = await vhost.declare_queue(
        caller,
        name=method.queue,
        owner=channel.conn.key,
        passive=method.passive,
        durable=method.durable,
        exclusive=method.exclusive,
        auto_delete=method.auto_delete,
        arguments=arguments,
    )
    if not method.nowait:
        count = await vhost.message_count(caller, queue)
        channel.send(
            commands.Queue.DeclareOk(
                queue=queue.name, message_count=count, consumer_count=queue.consumer_count
            )
        )


async def queue_bind(channel: Channel, method: commands.Queue.Bind | commands.Queue.Unbind) -> None:
    queue = method.queue
    binding = Binding(
        source=method.exchange,
        destination=queue,
        routing_key=method.routing_key,
        arguments=_binding_arguments(method.arguments),
    )
    unbind = isinstance(method, commands.Queue.Unbind)
    await _authorize(channel, queue, "write")
    await _authorize(channel, method.exchange, "read")
    await channel.conn.vhost.bind(
        channel.conn.caller, binding, owner=channel.conn.key, unbind=unbind
    )
    if unbind:
        channel.send(commands.Queue.UnbindOk())
    elif not getattr(method, "nowait", False):
        channel.send(commands.Queue.BindOk())


async def queue_purge(channel: Channel, method: commands.Queue.Purge) -> None:
    await _authorize(channel, method.queue, "delete")
    vhost = channel.conn.vhost
    queue = vhost.queue(method.queue, channel.conn.key, 50, 30)
    count = await vhost.purge(channel.conn.caller, queue)
    if not method.nowait:
        channel.send(commands.Queue.PurgeOk(message_count=count))


async def queue_delete(channel: Channel, method: commands.Queue.Delete) -> None:
    await _authorize(channel, method.queue, "delete")
    count = await channel.conn.vhost.delete_queue(
        channel.conn.caller,
        method.queue,
        owner=channel.conn.key,
        if_unused=method.if_unused,
        if_empty=method.if_empty,
    )
    if not method.nowait:
        channel.send(commands.Queue.DeleteOk(message_count=count))


def _binding_arguments(arguments: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((str(k), json_safe(v)) for k, v in (arguments or {}).items()))
