"""Two gateways over one storage: a bus and a rule made through one apply to events
ingested through the other, and the shared dispatch group delivers each event once
(both gateways run a dispatcher for the bus), in both forms."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.eventbus.harness import Webhook, post_binary, put_rule, run_id
from tests.live_server import LiveServer, live_gateways


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory, server_form: str
) -> Iterator[list[LiveServer]]:
    with live_gateways(tmp_path_factory.mktemp("eventbus-two"), ("http",), 2) as servers:
        yield servers


def _client(server: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{server.port('http')}", timeout=30)


def test_rules_made_on_one_gateway_deliver_events_of_the_other_once(
    gateways: list[LiveServer],
) -> None:
    run = run_id()
    bus = f"shared-{run}"
    hook = Webhook()
    first, second = _client(gateways[0]), _client(gateways[1])
    try:
        assert first.put(f"/buses/{bus}").status_code == 201
        put_rule(
            first,
            bus,
            "all",
            {
                "pattern": {"type": ["t"]},
                "targets": [{"id": "h", "type": "http", "endpoint": hook.url}],
            },
        )
        assert second.get(f"/buses/{bus}/rules/all").status_code == 200
        for i in range(20):
            post_binary(second if i % 2 else first, bus, "t", b"{}", id=f"{run}-{i}")
        received = hook.wait_for(20)
        ids = sorted(json.loads(body)["id"] for _, body in received)
        assert ids == sorted(f"{run}-{i}" for i in range(20))
        # Nothing more arrives: each event went to one gateway's dispatcher.
        with hook.condition:
            assert not hook.condition.wait_for(lambda: len(hook.received) > 20, timeout=2.0)
    finally:
        first.close()
        second.close()
        hook.close()
