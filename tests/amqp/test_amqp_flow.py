"""Publishing flow control: the listener's alarm (:class:`FlowControl`) blocks the
connections that publish, with connection.blocked / unblocked, as RabbitMQ's memory
and disk alarms do."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pika

from polymq.protocols.amqp.flow import FlowControl
from tests.amqp.conftest import WAIT_S, connect, unique
from tests.live_server import LiveServer


async def _alarm(flow: FlowControl, engaged: bool) -> None:
    if engaged:
        flow.engage("low on disk (test)")
    else:
        flow.release()


def _pump(conn: pika.BlockingConnection, condition: Callable[[], object]) -> None:
    """Run pika's I/O until ``condition`` holds (callbacks fire inside it)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        conn.process_data_events(time_limit=0.05)


def test_alarm_blocks_publishers_until_released(server: LiveServer) -> None:
    listener: Any = server.gateway.listeners.get("amqp")
    flow: FlowControl = listener.flow
    queue = unique("alarm")
    seen: list[Any] = []
    with connect(server) as publisher, connect(server) as consumer:
        publisher.add_on_connection_blocked_callback(lambda _c, frame: seen.append(frame.method))
        publisher.add_on_connection_unblocked_callback(lambda _c, frame: seen.append(frame.method))
        ch = publisher.channel()
        ch.queue_declare(queue)
        other = consumer.channel()
        server.call(lambda: _alarm(flow, True))
        try:
            ch.basic_publish("", queue, b"held")
            _pump(publisher, lambda: seen)
            [blocked] = seen
            assert isinstance(blocked, pika.spec.Connection.Blocked)
            assert blocked.reason == "low on disk (test)"
            # The publish is held, not stored; a connection that does not publish
            # is still served.
            assert other.queue_declare(queue, passive=True).method.message_count == 0
        finally:
            server.call(lambda: _alarm(flow, False))
        _pump(publisher, lambda: len(seen) == 2)
        assert isinstance(seen[1], pika.spec.Connection.Unblocked)
        deadline = time.monotonic() + WAIT_S
        while (got := other.basic_get(queue, auto_ack=True))[0] is None:
            assert time.monotonic() < deadline, "the held publish never arrived"
            consumer.sleep(0.05)
        assert got[2] == b"held"
        ch.basic_publish("", queue, b"free")  # released: publishing flows again
        assert ch.queue_declare(queue, passive=True).method.message_count == 1
        assert len(seen) == 2
