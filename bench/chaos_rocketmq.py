"""RocketMQ 5 in the chaos bench: rocketmq-python-client producers (normal messages,
``send`` one at a time) and one SimpleConsumer (receive, then ack each).

The client follows routes (which name the live gateways) and retries a send three
times by itself; the loop here starts a new client, beginning at the next gateway,
once one has failed for a while (its route or its stream may point at a dead gateway
for good). A message counts as acknowledged when ``send`` returned a receipt.
RocketMQ's message id is made by the client, and the client does not say which queue
a message came from, so neither stored copies nor order are told apart here."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)

from bench.chaos_client import Context, Pacer, Worker, backoff
from bench.chaos_history import body

__all__ = ["workers"]

_INVISIBLE_S = 10
_RESTART_AFTER_S = 5.0  # failing this long: a new client


def _topic(context: Context, index: int) -> str:
    return f"chaos-{context.run}-r{index}"


def _config(context: Context, attempt: int) -> Any:
    endpoints = ";".join(f"{h}:{p}" for h, p in context.addresses("rocketmq", attempt))
    return ClientConfiguration(endpoints, Credentials(), request_timeout=5)


def _shutdown(client: Any) -> None:
    with contextlib.suppress(Exception):
        client.shutdown()


class RocketProducer(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("producer", index), context)
        self.topic = _topic(context, index)

    def work(self) -> None:
        stop = self.context.stop_producing
        if not self.context.wait_subscribed():
            return
        pacer, seq, attempt = Pacer(self.context.rate), 0, 0
        while not stop.is_set():
            producer = Producer(_config(self.context, attempt), (self.topic,))
            try:
                producer.startup()
            except Exception as e:  # the client raises bare Exception on a failed start
                self.error(e, "startup")
                _shutdown(producer)
                attempt += 1
                self.history.on_reconnect("producer")
                backoff(stop, 0.5)
                continue
            failing_since: float | None = None
            while pacer.wait(stop):
                message = Message()
                message.topic = self.topic
                message.body = body(self.name, seq)
                self.history.on_sent()
                try:
                    producer.send(message)
                    self.history.on_acked(self.name, seq)
                    failing_since = None
                except Exception as e:
                    self.error(e, "send")
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > _RESTART_AFTER_S:
                        break
                finally:
                    seq += 1
            _shutdown(producer)
            if not stop.is_set():
                attempt += 1
                self.history.on_reconnect("producer")


class RocketConsumer(Worker):
    def __init__(self, context: Context) -> None:
        super().__init__(context.name("consumer"), context)
        self.topics = [_topic(context, i) for i in range(context.producers)]

    def work(self) -> None:
        stop, attempt = self.context.stop_consuming, 0
        while not stop.is_set():
            consumer = SimpleConsumer(
                _config(self.context, attempt),
                f"chaos-{self.context.run}",
                {t: FilterExpression() for t in self.topics},
                await_duration=2,
            )
            try:
                consumer.startup()
            except Exception as e:
                self.error(e, "startup")
                _shutdown(consumer)
                attempt += 1
                self.history.on_reconnect("consumer")
                backoff(stop, 0.5)
                continue
            self._consume(consumer)
            _shutdown(consumer)
            if not stop.is_set():
                attempt += 1
                self.history.on_reconnect("consumer")

    def _consume(self, consumer: Any) -> None:
        stop, failing_since = self.context.stop_consuming, None
        while not stop.is_set():
            try:
                messages = consumer.receive(16, _INVISIBLE_S)
                self.context.subscribed.set()
                failing_since = None
            except Exception as e:
                self.error(e, "receive")
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > _RESTART_AFTER_S:
                    return
                backoff(stop)
                continue
            for message in messages:
                attempts = message.delivery_attempt or 1
                self.history.on_delivered(message.body, queue=None, redelivered=attempts > 1)
                try:
                    consumer.ack(message)
                except Exception as e:  # comes back after its invisibility: a redelivery
                    self.error(e, "ack")


def workers(context: Context) -> list[Worker]:
    producers: list[Worker] = [RocketProducer(context, i) for i in range(context.producers)]
    return [RocketConsumer(context), *producers]
