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

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from bench.chaos_client import Context, Pacer, Worker, backoff, log
from bench.chaos_history import Delivery, body, delivery

__all__ = ["audit", "setup", "workers"]

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


def _queue(msg: Any) -> str:
    return f"{msg.topic()}/{msg.partition()}"


def _position(msg: Any) -> str:
    return f"{msg.topic()}/{msg.partition()}@{msg.offset()}"


def _stored(msg: Any) -> Delivery | None:
    return delivery(msg.value(), queue=_queue(msg), stored_at=_position(msg))


class KafkaProducer(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("producer", index), context)
        self.topic = _topic(context, index)
        self.fatal = threading.Event()

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.error(f"fatal {err.name()}: {err.str()[:120]}")
            self.fatal.set()
        else:
            self.error(f"error_cb {err.name()}")

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
                self._guarded(
                    lambda p=producer, n=seq: p.produce(
                        self.topic,
                        body(self.name, n),
                        headers=[("chaos-seq", str(n).encode())],
                        on_delivery=self._report(n),
                    )
                )
                self._guarded(lambda p=producer: p.poll(0))
                seq += 1
            if self.fatal.is_set():  # a new producer id: this one is fenced
                self.history.on_reconnect("producer")
                self._guarded(lambda p=producer: p.flush(1.0))
                backoff(stop)
                continue
            deadline = time.monotonic() + 30  # the last records, still in flight
            while len(producer) and time.monotonic() < deadline and not self.fatal.is_set():
                self._guarded(lambda p=producer: p.flush(1.0))
            if len(producer):
                self.history.on_stuck(f"{self.name}: {len(producer)} records unreported")

    def _guarded(self, call: Any) -> None:
        """A client call; a fatal error (raised from a callback too) fences this
        producer instead of ending the thread."""
        try:
            call()
        except BufferError:  # a long outage filled the local queue
            self.error("local queue full")
        except KafkaException as e:
            err = e.args[0]
            self.error(f"{'fatal' if err.fatal() else 'raised'} {err.name()}: {err.str()[:120]}")
            if err.fatal():
                self.fatal.set()

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
            except KafkaException as e:
                self.error(f"consumer {e.args[0].name()}")
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
            self.history.on_delivered(msg.value(), queue=_queue(msg), stored_at=_position(msg))
        return True


def workers(context: Context) -> list[Worker]:
    producers: list[Worker] = [KafkaProducer(context, i) for i in range(context.producers)]
    return [*producers, KafkaConsumer(context)]


def audit(context: Context, seconds: float = 60.0) -> None:
    """Read every partition from offset 0 to its end with a fresh consumer outside
    any group: what is stored, every copy, whatever the group consumer managed. It
    tells a record that is gone from one that is stored but was not delivered, and it
    sees every stored duplicate."""
    consumer = Consumer(
        {
            **_common(context),
            "group.id": f"chaos-{context.run}-audit",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    found: list[Delivery] = []
    deadline = time.monotonic() + seconds
    try:
        ends: dict[tuple[str, int], int] = {}
        for index in range(context.producers):
            for partition in range(PARTITIONS):
                topic = _topic(context, index)
                ends[(topic, partition)] = _high(consumer, topic, partition)
        consumer.assign([TopicPartition(t, p, 0) for (t, p), end in ends.items() if end > 0])
        done = {key for key, end in ends.items() if end == 0}
        while len(done) < len(ends) and time.monotonic() < deadline:
            msg: Any = consumer.poll(0.5)
            if msg is None:
                continue
            key = (msg.topic(), msg.partition())
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    done.add(key)
                continue
            if (d := _stored(msg)) is not None:
                found.append(d)
            if msg.offset() + 1 >= ends[key]:
                done.add(key)
        if len(done) < len(ends):
            context.history.on_stuck(f"audit: read {len(done)} of {len(ends)} partitions")
    finally:
        consumer.close()
    context.history.record_audit(found)


def _high(consumer: Consumer, topic: str, partition: int) -> int:
    deadline = time.monotonic() + 30
    while True:
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)
            return int(high)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
