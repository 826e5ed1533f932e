"""MNS in the chaos bench: the aliyun-mns-sdk sending one message at a time and a
consumer receiving (long poll) and deleting each.

The SDK talks to one endpoint: the loop here makes a new ``Account`` on the next
gateway after a network error or a 5xx. A message counts as acknowledged when
``send_message`` returned (201 with a message id). The message id is the server's,
so a second id for one body is a second stored copy, and a message received again
(``DequeueCount`` > 1) after its visibility ran out is a redelivery."""

from __future__ import annotations

from typing import Any

from mns.account import Account
from mns.mns_exception import MNSExceptionBase, MNSServerException
from mns.queue import Message, QueueMeta

from bench.chaos_client import Context, Pacer, Worker, backoff
from bench.chaos_history import body

__all__ = ["workers"]

_VISIBILITY_S = 10
_BATCH = 16
_TIMEOUT_S = 10
_KEY = "chaos"  # open auth mode: any key is let in, unchecked


def _queue_name(context: Context, index: int) -> str:
    return f"chaos-{context.run}-s{index}"


def _queue(context: Context, index: int, attempt: int) -> Any:
    host, port = context.addresses("http", attempt)[0]
    account = Account(f"http://{host}:{port}", _KEY, _KEY)
    account.mns_client.set_connection_timeout(_TIMEOUT_S)
    queue = account.get_queue(_queue_name(context, index))
    queue.set_encoding(False)
    return queue


def _create(queue: Any) -> None:
    try:
        queue.create(QueueMeta(vis_timeout=_VISIBILITY_S, polling_wait_sec=0))
    except MNSServerException as e:
        if e.type != "QueueAlreadyExist":
            raise


class MnsSender(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("producer", index), context)
        self.index = index

    def work(self) -> None:
        pacer, seq, attempt = Pacer(self.context.rate), 0, 0
        stop = self.context.stop_producing
        while not stop.is_set():
            try:
                queue = _queue(self.context, self.index, attempt)
                _create(queue)
                while pacer.wait(stop):
                    self.history.on_sent()
                    seq += 1
                    queue.send_message(Message(body(self.name, seq - 1).decode()))
                    self.history.on_acked(self.name, seq - 1)
            except (MNSExceptionBase, OSError) as e:
                self.error(f"{type(e).__name__} {getattr(e, 'type', '')}")
                self.history.on_reconnect("producer")
                attempt += 1
                backoff(stop)


class MnsReceiver(Worker):
    def __init__(self, context: Context, index: int) -> None:
        super().__init__(context.name("consumer", index), context)
        self.index = index
        self.queue_name = _queue_name(context, index)

    def work(self) -> None:
        attempt, stop = 0, self.context.stop_consuming
        while not stop.is_set():
            try:
                queue = _queue(self.context, self.index, attempt)
                _create(queue)
                while not stop.is_set():
                    self._one(queue)
            except (MNSExceptionBase, OSError) as e:
                self.error(f"{type(e).__name__} {getattr(e, 'type', '')}")
                self.history.on_reconnect("consumer")
                attempt += 1
                backoff(stop)

    def _one(self, queue: Any) -> None:
        """One batch: up to 16 received (long poll 1 s), recorded, deleted at once,
        so the consumer keeps up with the producer over one request per batch."""
        try:
            batch = queue.batch_receive_message(_BATCH, 1)
        except MNSServerException as e:
            if e.type == "MessageNotExist":
                return
            raise
        for got in batch:
            self.history.on_delivered(
                got.message_body,
                queue=self.queue_name,
                stored_at=got.message_id,
                redelivered=int(got.dequeue_count or 1) > 1,
            )
        queue.batch_delete_message([got.receipt_handle for got in batch])


def workers(context: Context) -> list[Worker]:
    every: list[Worker] = []
    for i in range(context.producers):
        every += [MnsSender(context, i), MnsReceiver(context, i)]
    return every
