"""A gateway restart loses nothing: events a dispatcher holds while its webhook
fails (tried once, waiting to retry) are delivered after the gateway is stopped and
started again over the same storage, once the webhook answers, in both forms."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.eventbus.harness import Webhook, post_binary, put_rule
from tests.live_server import live_server

EVENTS = 5


def test_events_held_across_a_restart_are_delivered(tmp_path: Path) -> None:
    failing = Webhook(fail=1_000_000)
    port, url = failing.port, failing.url
    with live_server(tmp_path, ("http",)) as server:
        client = httpx.Client(base_url=f"http://127.0.0.1:{server.port('http')}", timeout=30)
        put_rule(
            client,
            "default",
            "webhook",
            {
                "pattern": {"type": ["restart.test"]},
                "targets": [
                    {
                        "id": "hook",
                        "type": "http",
                        "endpoint": url,
                        "retry": {"maximum_attempts": 10, "backoff_ms": 30_000},
                    }
                ],
            },
        )
        for i in range(EVENTS):
            post_binary(client, "default", "restart.test", b"{}", id=f"r{i}")
        # Each tried once and refused: the dispatcher holds them, to retry in 30 s.
        failing.wait_for(EVENTS)
        failing.close()
        client.close()
    hook = Webhook(port=port)
    try:
        with live_server(tmp_path, ("http",)):
            received = hook.wait_for(EVENTS, timeout=60)
            assert {headers.get("x-test-path") for headers, _ in received} == {"/hook"}
            delivered = {json.loads(body)["id"] for _, body in received}
            assert delivered == {f"r{i}" for i in range(EVENTS)}
    finally:
        hook.close()
