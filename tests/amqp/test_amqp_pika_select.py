"""pika's asynchronous SelectConnection: callbacks all the way, as event-driven
applications use it (declare, confirm, consume with prefetch, ack)."""

from __future__ import annotations

from typing import Any

import pika
from pika.adapters.select_connection import SelectConnection

from tests.amqp.conftest import WAIT_S, params, unique
from tests.live_server import LiveServer


def test_select_connection_publishes_with_confirms_and_consumes(server: LiveServer) -> None:
    queue = unique("select")
    total = 200
    state: dict[str, Any] = {"acked": 0, "received": [], "redelivered": 0}

    def on_open(conn: SelectConnection) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_channel(ch: Any) -> None:
        state["channel"] = ch
        ch.confirm_delivery(on_confirm)
        ch.queue_declare(
            queue, durable=True, callback=lambda _: ch.basic_qos(prefetch_count=50, callback=on_qos)
        )

    def on_qos(_: Any) -> None:
        ch = state["channel"]
        ch.basic_consume(queue, on_message)
        for i in range(total):
            ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))

    def on_confirm(frame: Any) -> None:
        method = frame.method
        assert isinstance(method, pika.spec.Basic.Ack)
        state["acked"] = method.delivery_tag if method.multiple else state["acked"] + 1
        finish_if_done()

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        state["received"].append(int(body))
        state["redelivered"] += method.redelivered
        ch.basic_ack(method.delivery_tag)
        finish_if_done()

    def finish_if_done() -> None:
        if state["acked"] == total and len(state["received"]) == total:
            conn.close()

    conn = SelectConnection(params(server), on_open_callback=on_open)
    timer = conn.ioloop.call_later(WAIT_S, conn.ioloop.stop)
    conn.add_on_close_callback(lambda *_: conn.ioloop.stop())
    conn.ioloop.start()
    conn.ioloop.remove_timeout(timer)
    assert state["acked"] == total
    assert state["received"] == list(range(total))
    assert state["redelivered"] == 0
