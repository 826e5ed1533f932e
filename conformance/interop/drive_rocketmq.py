"""RocketMQ 5 through rocketmq-python-client: keys, tag and user properties are the
message's own; the content type, correlation id and reply-to travel as the user
properties ``content-type``, ``correlation-id`` and ``reply-to``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)

from polymq.conformance.interop.driver import poll
from polymq.conformance.interop.fields import Arrived, Sent
from polymq.protocols import interop

__all__ = ["RocketMQDriver"]

_INVISIBLE_S = 30


class RocketMQDriver:
    protocol = "rocketmq"
    client = "rocketmq-python-client"

    def __init__(self, host: str, port: int) -> None:
        self._config = ClientConfiguration(f"{host}:{port}", Credentials("", ""), "")
        self._producer = Producer(self._config)
        self._producer.startup()
        # One consumer (group) for every cell, subscribed to one cell's topic at a
        # time: a client's start-up costs more than the rest of a cell.
        self._consumer = SimpleConsumer(
            self._config, f"interop-{uuid.uuid4().hex[:8]}", await_duration=2
        )
        self._consumer.startup()

    def prepare(self, topic: str) -> None:
        """Nothing: the group has no position in a new topic yet, so its pops start at
        the first message."""

    def produce(self, topic: str, sent: Sent) -> None:
        message = Message()
        message.topic = topic
        message.body = sent.body
        message.keys = sent.key
        message.tag = sent.tag
        message.add_property(interop.CONTENT_TYPE, sent.content_type)
        message.add_property(interop.CORRELATION_ID, sent.correlation_id)
        message.add_property(interop.REPLY_TO, sent.reply_to)
        for name, value in sent.properties:
            message.add_property(name, value)
        for attempt in range(3):
            try:
                self._producer.send(message)
                return
            except Exception as e:
                # The client gives up a route query after 3 s of its own, which a
                # loaded machine can exceed; the send itself was never tried then.
                if "route" not in str(e) or attempt == 2:
                    raise
                time.sleep(0.5)

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        consumer = self._consumer
        consumer.subscribe(topic, FilterExpression())
        try:

            def take(remaining: float) -> Any:
                got = consumer.receive(1, _INVISIBLE_S)
                return got[0] if got else None

            message = poll(take, timeout_s, "rocketmq")
            consumer.ack(message)
        finally:
            consumer.unsubscribe(topic)
        properties = dict(message.properties or {})
        content_type = properties.pop(interop.CONTENT_TYPE, None)
        correlation_id = properties.pop(interop.CORRELATION_ID, None)
        reply_to = properties.pop(interop.REPLY_TO, None)
        keys = message.keys
        return Arrived(
            body=message.body,
            key=" ".join(sorted(keys)) if keys else None,
            tag=message.tag,
            properties=properties,
            content_type=content_type,
            correlation_id=correlation_id,
            reply_to=reply_to,
        )

    def close(self) -> None:
        self._consumer.shutdown()
        self._producer.shutdown()
