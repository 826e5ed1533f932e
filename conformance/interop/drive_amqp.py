"""AMQP 0-9-1 through pika. The routing key is the key, ``content_type`` the content
type, headers carry the tag (``polymq.tag``) and the user's properties. Storage topics
are reached through ``x-polymq-topic``: an exchange declared with it appends every
publish to the topic, a queue declared with it is consumed from the topic
(docs/interop.md, addressing)."""

from __future__ import annotations

from typing import Any

import pika
from pika.adapters.blocking_connection import BlockingChannel

from polymq.conformance.interop.driver import poll
from polymq.conformance.interop.fields import Arrived, Sent
from polymq.protocols import interop

__all__ = ["AmqpDriver", "AmqpNaturalDriver"]


class AmqpDriver:
    protocol = "amqp"
    client = "pika"

    def __init__(self, host: str, port: int) -> None:
        self._parameters = pika.ConnectionParameters(host=host, port=port, heartbeat=0)
        self._connection = pika.BlockingConnection(self._parameters)
        self._channel = self._connection.channel()
        self._channel.confirm_delivery()

    def _open(self) -> BlockingChannel:
        """The channel, opened again if a failed cell's channel error closed it, so
        one failure does not take the following cells with it."""
        if not self._connection.is_open:
            self._connection = pika.BlockingConnection(self._parameters)
        if not self._channel.is_open:
            self._channel = self._connection.channel()
            self._channel.confirm_delivery()
        return self._channel

    def prepare(self, topic: str) -> None:
        self._open().queue_declare(
            queue=topic, durable=True, arguments={interop.AMQP_TOPIC_ARGUMENT: topic}
        )

    def produce(self, topic: str, sent: Sent) -> None:
        channel = self._open()
        channel.exchange_declare(
            exchange=topic,
            exchange_type="fanout",
            durable=True,
            arguments={interop.AMQP_TOPIC_ARGUMENT: topic},
        )
        self._publish(channel, topic, sent, mandatory=True)

    def _publish(
        self, channel: BlockingChannel, exchange: str, sent: Sent, mandatory: bool
    ) -> None:
        headers: dict[str, Any] = {interop.TAG: sent.tag, **dict(sent.properties)}
        properties = pika.BasicProperties(
            content_type=sent.content_type,
            correlation_id=sent.correlation_id,
            reply_to=sent.reply_to,
            headers=headers,
        )
        channel.basic_publish(exchange, sent.key, sent.body, properties, mandatory=mandatory)

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        return self._consume(topic, timeout_s)

    def _consume(self, queue: str, timeout_s: float) -> Arrived:
        channel = self._open()

        def take(remaining: float) -> Any:
            for method, properties, body in channel.consume(
                queue, inactivity_timeout=min(remaining, 1.0)
            ):
                if method is None:
                    return None
                channel.basic_ack(method.delivery_tag)
                return method, properties, body
            return None

        try:
            method, properties, body = poll(take, timeout_s, "amqp")
        finally:
            channel.cancel()
        headers = {
            name: value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            for name, value in (properties.headers or {}).items()
        }
        key = headers.pop(interop.KEY, None) or method.routing_key
        tag = headers.pop(interop.TAG, None)
        return Arrived(
            body=body,
            key=key,
            tag=tag,
            properties=headers,
            content_type=properties.content_type,
            correlation_id=properties.correlation_id,
            reply_to=properties.reply_to,
        )

    def close(self) -> None:
        if self._connection.is_open:
            self._connection.close()


class AmqpNaturalDriver(AmqpDriver):
    """What a RabbitMQ application does, with no polymq-specific argument: it
    publishes to a topic exchange named after the topic and consumes a queue of its
    own bound to that exchange with ``#`` (docs/interop.md, natural names). Fields
    without an AMQP slot (the tag, the user's properties) still travel as headers."""

    client = "pika (natural names)"

    def _declare_exchange(self, channel: BlockingChannel, topic: str) -> None:
        channel.exchange_declare(exchange=topic, exchange_type="topic", durable=True)

    def prepare(self, topic: str) -> None:
        channel = self._open()
        self._declare_exchange(channel, topic)
        channel.queue_declare(queue=_bound_queue(topic), durable=True)
        channel.queue_bind(queue=_bound_queue(topic), exchange=topic, routing_key="#")

    def produce(self, topic: str, sent: Sent) -> None:
        channel = self._open()
        self._declare_exchange(channel, topic)
        self._publish(channel, topic, sent, mandatory=False)

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        return self._consume(_bound_queue(topic), timeout_s)


def _bound_queue(topic: str) -> str:
    return f"{topic}-app"
