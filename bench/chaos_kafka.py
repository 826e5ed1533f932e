"""Kafka in the chaos bench: an idempotent confluent-kafka producer (acks=all) and a
consumer group member.

librdkafka reconnects and moves between brokers (gateways) by itself, from Metadata;
what the application adds is a new client after a fatal error (an idempotent producer
whose guarantee broke is fenced for good) and the record of what it was told. The
consumer records each record's partition and offset: one id at two offsets is a
second stored copy (an idempotence failure), one id twice at the same offset is a
redelivery (a rebalance before the commit)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from bench.chaos_client import Context, Pacer, Worker, backoff, log
from bench.chaos_history import body

__all__ = ["setup", "workers"]

PARTITIONS = 2
_TIMEOUT_MS = 120_000  # a record is retried through any outage shorter than this
_CLIENT_LOG = logging.getLogger("bench.chaos.librdkafka")


def _topic(context: Context, index: int) -> str:
    return f"chaos-{context.run}-k{index}"


def _bootstrap(context: Context) -> str:
    return ",".join(f"{h}:{p}" for h, p in context.gateways["kafka"])


def _common(context: Context) -> dict[str, Any]:
    return {
        "bootstrap.servers": _bootstrap(context),
        "topic.metadata.refresh.interval.ms": 1000,
        "reconnect.backoff.max.ms": 500,
        "logger": _CLIENT_LOG,
    }


def setup(context: Context) -> None:
    """The topics, created before the clients start (retried: the cluster has just
    come up and its routes may still be settling)."""
    admin = AdminClient(_common(context))
    deadline = time.monotonic() + 60
    for index in range(context.producers):
        topic = _topic(context, index)
        while True:
            try:
                admin.create_topics([NewTopic(topic, PARTITIONS)])[topic].result(15)
                break
            except KafkaException as e:
                if e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    break
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


class KafkaProducer(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("producer", index), context)
        self.topic = _topic(context, index)
        self.fatal = threading.Event()

    def _on_error(self, err: KafkaError) -> None:
        self.error(f"error_cb {err.name()}")
        if err.fatal():
            self.fatal.set()

    def work(self) -> None:
        pacer, seq, stop = Pacer(self.context.rate), 0, self.context.stop_producing
        config = {
            **_common(self.context),
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "message.timeout.ms": _TIMEOUT_MS,
            "error_cb": self._on_error,
        }
        while not stop.is_set():
            self.fatal.clear()
            producer = Producer(config)
            while not self.fatal.is_set() and pacer.wait(stop):
                self.history.on_sent()
                producer.produce(
                    self.topic,
                    body(self.name, seq),
                    headers=[("chaos-seq", str(seq).encode())],
                    on_delivery=self._report(seq),
                )
                producer.poll(0)
                seq += 1
            if self.fatal.is_set():  # a new producer id: this one is fenced
                self.history.on_reconnect("producer")
                producer.flush(1.0)
                backoff(stop)
                continue
            deadline = time.monotonic() + 30  # the last records, still in flight
            while len(producer) and time.monotonic() < deadline:
                producer.flush(1.0)
            if len(producer):
                self.history.on_stuck(f"{self.name}: {len(producer)} records unreported")

    def _report(self, seq: int) -> Any:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is None:
                self.history.on_acked(self.name, seq)
            else:
                self.error(f"delivery {err.name()}")

        return delivered


class KafkaConsumer(Worker):
    def __init__(self, context: Context) -> None:
        super().__init__(context.name("consumer"), context)

    def work(self) -> None:
        stop = self.context.stop_consuming
        topics = [_topic(self.context, i) for i in range(self.context.producers)]
        while not stop.is_set():
            consumer = Consumer(
                {
                    **_common(self.context),
                    "group.id": f"chaos-{self.context.run}",
                    "auto.offset.reset": "earliest",
                    "enable.auto.commit": True,
                    "auto.commit.interval.ms": 500,
                    "session.timeout.ms": 6000,
                    "heartbeat.interval.ms": 1000,
                }
            )
            consumer.subscribe(topics)
            try:
                if self._consume(consumer):
                    return
            finally:
                try:
                    consumer.close()
                except (KafkaException, RuntimeError) as e:
                    log.info("%s: close: %s", self.name, e)
            self.history.on_reconnect("consumer")
            backoff(stop)

    def _consume(self, consumer: Consumer) -> bool:
        """Until stopped (``True``) or a fatal error (``False``: start again)."""
        stop = self.context.stop_consuming
        while not stop.is_set():
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if (err := msg.error()) is not None:
                self.error(f"consume {err.name()}")
                if err.fatal():
                    return False
                continue
            self.history.on_delivered(
                msg.value(),
                queue=f"{msg.topic()}/{msg.partition()}",
                stored_at=f"{msg.topic()}/{msg.partition()}@{msg.offset()}",
            )
        return True


def workers(context: Context) -> list[Worker]:
    producers: list[Worker] = [KafkaProducer(context, i) for i in range(context.producers)]
    return [*producers, KafkaConsumer(context)]
