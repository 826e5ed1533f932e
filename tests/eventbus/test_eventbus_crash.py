"""A gateway killed with SIGKILL while it holds events loses none: events whose
webhook failed (tried once, held for a retry) are delivered by the restarted server
once their invisibility (30 s) runs out. The merged form, as a real ``polymq run``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from polymq.protocols.eventbus.dispatcher import INVISIBLE_MS
from tests.crash_server import crash_server
from tests.eventbus.harness import Webhook, post_binary, put_rule

EVENTS = 3


def test_events_held_by_a_killed_gateway_are_delivered(tmp_path: Path) -> None:
    failing = Webhook(fail=1_000_000)
    port, url = failing.port, failing.url
    with (
        crash_server(tmp_path, "http") as http_port,
        httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as client,
    ):
        put_rule(
            client,
            "default",
            "hook",
            {
                "pattern": {"type": ["crash.test"]},
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
            post_binary(client, "default", "crash.test", b"{}", id=f"k{i}")
        failing.wait_for(EVENTS)  # each tried once: held, waiting to retry
    # killed here, holding every event
    failing.close()
    hook = Webhook(port=port)
    try:
        with crash_server(tmp_path, "http"):
            received = hook.wait_for(EVENTS, timeout=INVISIBLE_MS / 1000 + 30)
        assert {json.loads(body)["id"] for _, body in received} == {f"k{i}" for i in range(EVENTS)}
    finally:
        hook.close()
