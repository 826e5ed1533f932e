"""AMQP 0-9-1 in the chaos bench: pika publishers with confirms on durable queues and
a consumer acking each delivery.

pika does not reconnect: the loop here does, to the next gateway, and declares the
queue again (durable, so declaring is idempotent). A message counts as acknowledged
only when ``basic_publish`` returned on a confirming channel (a nack or an unroutable
return raises). A consumer whose channel the server closed (pika's
``process_data_events`` does not raise for it) consumes anew, as an application that
watches its channel would; the error is counted."""

from __future__ import annotations

import contextlib
from typing import Any

import pika
from pika.exceptions import AMQPError

from bench.chaos_client import Context, Pacer, Worker, backoff
from bench.chaos_history import body

__all__ = ["workers"]

_PERSISTENT = pika.BasicProperties(delivery_mode=2)
_PREFETCH = 20


def _queue(context: Context, index: int) -> str:
    return f"chaos-{context.run}-a{index}"


def _connect(context: Context, attempt: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        [
            pika.ConnectionParameters(
                host,
                port,
                heartbeat=5,
                connection_attempts=1,
                socket_timeout=5,
                blocked_connection_timeout=30,
            )
            for host, port in context.addresses("amqp", attempt)
        ]
    )


def _close(connection: pika.BlockingConnection | None) -> None:
    if connection is not None:
        with contextlib.suppress(Exception):  # it is usually dead already
            connection.close()


class AmqpPublisher(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("producer", index), context)
        self.queue = _queue(context, index)

    def work(self) -> None:
        pacer, seq, attempt = Pacer(self.context.rate), 0, 0
        stop = self.context.stop_producing
        while not stop.is_set():
            connection = None
            try:
                connection = _connect(self.context, attempt)
                channel = connection.channel()
                channel.queue_declare(self.queue, durable=True)
                channel.confirm_delivery()
                while pacer.wait(stop):
                    self.history.on_sent()
                    seq += 1
                    channel.basic_publish(
                        "", self.queue, body(self.name, seq - 1), _PERSISTENT, mandatory=True
                    )
                    self.history.on_acked(self.name, seq - 1)
            except (AMQPError, OSError) as e:
                self.error(e)
                self.history.on_reconnect("producer")
                attempt += 1
                backoff(stop)
            finally:
                _close(connection)


class AmqpConsumer(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("consumer", index), context)
        self.queue = _queue(context, index)

    def _on_message(self, channel: Any, method: Any, _props: Any, raw: bytes) -> None:
        self.history.on_delivered(raw, queue=self.queue, redelivered=bool(method.redelivered))
        channel.basic_ack(method.delivery_tag)

    def work(self) -> None:
        attempt, stop = 0, self.context.stop_consuming
        while not stop.is_set():
            connection = None
            try:
                connection = _connect(self.context, attempt)
                channel = connection.channel()
                channel.queue_declare(self.queue, durable=True)
                channel.basic_qos(prefetch_count=_PREFETCH)
                channel.basic_consume(self.queue, self._on_message)
                while not stop.is_set() and channel.is_open:
                    connection.process_data_events(time_limit=0.25)
                if not stop.is_set():  # the server closed the channel: consume anew
                    self.error(f"channel closed: {getattr(channel, '_closing_reason', '?')}")
                    self.history.on_reconnect("consumer")
                    attempt += 1
                    backoff(stop)
            except (AMQPError, OSError) as e:
                self.error(e)
                self.history.on_reconnect("consumer")
                attempt += 1
                backoff(stop)
            finally:
                _close(connection)


def workers(context: Context) -> list[Worker]:
    every: list[Worker] = []
    for i in range(context.producers):
        every += [AmqpPublisher(context, i), AmqpConsumer(context, i)]
    return every
