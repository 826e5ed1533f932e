"""Shared by the event bus tests: a webhook that records what it is sent, a bus API
client over httpx, and a Kafka reader of a storage topic."""

from __future__ import annotations

import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from kafka import KafkaConsumer

WAIT_S = 30.0

Received = tuple[dict[str, str], bytes]


class Webhook:
    """An HTTP endpoint on a free port (or ``port``) recording every POST; the
    first ``fail`` requests are answered 500."""

    def __init__(self, fail: int = 0, port: int = 0) -> None:
        self.fail = fail
        self.received: list[Received] = []
        self.condition = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with hook.condition:
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    headers["x-test-path"] = self.path  # which target it was
                    hook.received.append((headers, body))
                    failing = len(hook.received) <= hook.fail
                    hook.condition.notify_all()
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, timeout: float = WAIT_S) -> list[Received]:
        with self.condition:
            assert self.condition.wait_for(lambda: len(self.received) >= count, timeout), (
                f"got {len(self.received)} of {count} requests"
            )
            return list(self.received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_id() -> str:
    return uuid.uuid4().hex[:8]


def put_rule(client: httpx.Client, bus: str, rule: str, document: dict[str, Any]) -> None:
    response = client.put(f"/buses/{bus}/rules/{rule}", json=document)
    assert response.status_code in (200, 201), response.text


def post_binary(
    client: httpx.Client, bus: str, event_type: str, data: bytes, **attributes: str
) -> httpx.Response:
    headers = {
        "ce-specversion": "1.0",
        "ce-id": attributes.pop("id", run_id()),
        "ce-source": attributes.pop("source", "/tests"),
        "ce-type": event_type,
        "content-type": attributes.pop("content_type", "application/json"),
        **{f"ce-{name}": value for name, value in attributes.items()},
    }
    response = client.post(f"/buses/{bus}/events", headers=headers, content=data)
    assert response.status_code == 202, response.text
    return response


def kafka_read(port: int, topic: str, count: int, timeout: float = WAIT_S) -> list[Any]:
    """``count`` records of ``topic`` from its start, with a real Kafka consumer."""
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=f"127.0.0.1:{port}",
        group_id=f"eventbus-test-{run_id()}",
        auto_offset_reset="earliest",
        consumer_timeout_ms=1_000,
    )
    records: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(records) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
    finally:
        consumer.close()
    assert len(records) >= count, f"got {len(records)} of {count} records from {topic}"
    return records
