"""kombu (celery's messaging layer, over py-amqp): a task queue on a direct exchange,
consumed with acks, the way celery workers use it. Skipped when kombu is absent (it is
not pinned in pyproject.toml)."""

from __future__ import annotations

import pytest

from tests.amqp.conftest import WAIT_S, unique
from tests.live_server import LiveServer

kombu = pytest.importorskip("kombu")


def test_kombu_task_queue_round_trip(server: LiveServer) -> None:
    exchange = kombu.Exchange(unique("tasks"), type="direct", durable=True)
    queue = kombu.Queue(unique("celery"), exchange, routing_key="task", durable=True)
    url = f"amqp://guest:guest@127.0.0.1:{server.port('amqp')}//"
    with kombu.Connection(url, connect_timeout=WAIT_S) as conn:
        producer = conn.Producer(serializer="json")
        for i in range(5):
            producer.publish(
                {"task": "add", "args": [i, i]},
                exchange=exchange,
                routing_key="task",
                declare=[queue],
                headers={"id": f"t{i}"},
                retry=True,
            )
        got: list[tuple[object, object]] = []

        def on_message(body: object, message: object) -> None:
            got.append((body, message.headers["id"]))  # type: ignore[attr-defined]
            message.ack()  # type: ignore[attr-defined]

        with conn.Consumer(queue, callbacks=[on_message], prefetch_count=2):
            while len(got) < 5:
                conn.drain_events(timeout=WAIT_S)
        assert got == [({"task": "add", "args": [i, i]}, f"t{i}") for i in range(5)]
        assert queue(conn.default_channel).queue_declare(passive=True).message_count == 0
