"""Kafka through kafka-python: the record key is the key, headers carry the rest
(``polymq.tag``, ``content-type``, ``correlation-id``, ``reply-to``, the user's own
headers)."""

from __future__ import annotations

import contextlib
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from polymq.conformance.interop.driver import poll
from polymq.conformance.interop.fields import Arrived, Sent
from polymq.protocols import interop

__all__ = ["KafkaDriver"]

_FIELD_HEADERS = (interop.TAG, interop.CONTENT_TYPE, interop.CORRELATION_ID, interop.REPLY_TO)


class KafkaDriver:
    protocol = "kafka"
    client = "kafka-python"

    def __init__(self, host: str, port: int) -> None:
        bootstrap = f"{host}:{port}"
        self._producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=500
        )
        self._admin = KafkaAdminClient(bootstrap_servers=bootstrap)

    def prepare(self, topic: str) -> None:
        """One partition, so whatever another protocol appends is in partition 0."""
        with contextlib.suppress(TopicAlreadyExistsError):
            self._admin.create_topics([NewTopic(topic, 1, 1)])

    def produce(self, topic: str, sent: Sent) -> None:
        headers = [
            (interop.TAG, sent.tag.encode()),
            (interop.CONTENT_TYPE, sent.content_type.encode()),
            (interop.CORRELATION_ID, sent.correlation_id.encode()),
            (interop.REPLY_TO, sent.reply_to.encode()),
            *((name, value.encode()) for name, value in sent.properties),
        ]
        future = self._producer.send(topic, sent.body, key=sent.key.encode(), headers=headers)
        future.get(timeout=20)

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        partition = TopicPartition(topic, 0)
        self._consumer.assign([partition])
        self._consumer.seek(partition, 0)

        def take(remaining: float) -> Any:
            batches = self._consumer.poll(timeout_ms=int(min(remaining, 1.0) * 1000))
            records = batches.get(partition, [])
            return records[0] if records else None

        record = poll(take, timeout_s, "kafka")
        fields: dict[str, str] = {}
        properties: dict[str, str] = {}
        for name, value in record.headers:
            text = (value or b"").decode("utf-8", "replace")
            if name in _FIELD_HEADERS and name not in fields:
                fields[name] = text
            else:
                properties[name] = text
        return Arrived(
            body=record.value or b"",
            key=record.key.decode("utf-8", "replace") if record.key is not None else None,
            tag=fields.get(interop.TAG),
            properties=properties,
            content_type=fields.get(interop.CONTENT_TYPE),
            correlation_id=fields.get(interop.CORRELATION_ID),
            reply_to=fields.get(interop.REPLY_TO),
        )

    def close(self) -> None:
        self._producer.close(timeout=5)
        self._consumer.close()
        self._admin.close()
