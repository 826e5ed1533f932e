"""A gateway started while no storage node is up starts anyway, answers the
protocol's retryable error meanwhile, and serves once a node registers (as a RabbitMQ
node starts with a quorum queue's leader away). It used to exit after 30 s with
``cannot start: no live storage node``, which under a supervisor only restarted it into
the same wait."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx

from polymq.gateway.cluster_tool import LocalCluster, layout
from tests.cluster.fast_failure import cluster_env

_JSON = {"Accept": "application/json", "Content-Type": "application/json"}
_TIMEOUT_S = 60.0


async def test_a_gateway_started_before_storage_serves_once_storage_comes(
    tmp_path: Path,
) -> None:
    specs = layout(storage=1, gateways=1, data_dir=tmp_path, port_offset=None)
    env = cluster_env()
    env["POLYMQ_CLUSTER__STORAGE_WAIT_MS"] = "200"  # not the default 30 s wait
    cluster = LocalCluster(specs, env=env)
    try:
        for name in ("nameserver", "navigation", "gateway-1"):
            await cluster.start(name)  # returns once ready: no storage node yet
        host, port = cluster.address("gateway-1", "http")
        queue = f"q{uuid.uuid4().hex[:8]}"
        async with httpx.AsyncClient(
            base_url=f"http://{host}:{port}", headers=_JSON, timeout=30.0
        ) as http:
            before = await http.put(f"/queues/{queue}")
            assert before.status_code == 503, before.text
            assert before.json()["Code"] == "ServiceUnavailable"

            await cluster.start("storage-1")

            deadline = time.monotonic() + _TIMEOUT_S
            while (created := await http.put(f"/queues/{queue}")).status_code != 201:
                assert created.status_code == 503, created.text
                assert time.monotonic() < deadline, "the gateway never used the new node"
                await asyncio.sleep(0.1)
            sent = await http.post(f"/queues/{queue}/messages", json={"MessageBody": "hello"})
            assert sent.status_code == 201, sent.text
            got = await http.get(f"/queues/{queue}/messages", params={"numOfMessages": 16})
            assert got.status_code == 200, got.text
            assert [m["MessageBody"] for m in got.json()["Messages"]] == ["hello"]
        assert "gateway-1" not in cluster.exited()
    finally:
        await cluster.stop()
