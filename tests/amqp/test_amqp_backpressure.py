"""A consumer that stops reading its socket stops its deliveries.

The server writes a consumer's deliveries to the transport and then waits for the
transport's buffer to drain below its mark (``AmqpConnection.drain``). Draining is
skipped when nothing is buffered, which is the common case at everyday rates: this
checks that a peer that reads nothing still pushes back, rather than the server
popping the whole queue into memory for a socket that never empties.
"""

from __future__ import annotations

import time

import pika
import pytest

from tests.amqp.conftest import WAIT_S, connect, unique, wait_for
from tests.live_server import LiveServer

BODY = b"x" * 16_384
# 20 MiB: well over what loopback's socket buffers (a 4 MiB send buffer, a receive
# window that does not grow while nothing is read) and a turn of 250 deliveries hold.
TOTAL = 1_280
# How long the queue must stay non-empty while the consumer reads nothing.
HELD_S = 3.0


def _ready(channel: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> int:
    count: int = channel.queue_declare(queue, passive=True).method.message_count
    return count


def test_a_consumer_that_reads_nothing_is_not_handed_the_whole_queue(server: LiveServer) -> None:
    queue = unique("unread")
    with connect(server) as conn:
        ch = conn.channel()
        ch.queue_declare(queue)
        for _ in range(TOTAL):
            ch.basic_publish("", queue, BODY)
        wait_for(lambda: _ready(ch, queue) == TOTAL)
        got = 0

        def count(*_: object) -> None:
            nonlocal got
            got += 1

        with connect(server) as slow:
            sch = slow.channel()
            sch.basic_consume(queue, count, auto_ack=True)  # then reads nothing
            wait_for(lambda: _ready(ch, queue) < TOTAL)  # deliveries began
            with pytest.raises(AssertionError):  # and stop while the socket is full
                wait_for(lambda: _ready(ch, queue) == 0, timeout=HELD_S)
            assert _ready(ch, queue) > 0
            # Once it reads, everything arrives: held back, not lost.
            deadline = time.monotonic() + WAIT_S
            while got < TOTAL and time.monotonic() < deadline:
                slow.process_data_events(time_limit=0.2)
            assert got == TOTAL
        ch.queue_delete(queue)
