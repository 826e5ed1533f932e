"""kafkajs (node) against the gateway: admin, produce with gzip, a consumer group."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.kafka.clients import run_node


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_kafkajs_round_trip(bootstrap: str, topic: str) -> None:
    done = run_node("kafka_roundtrip.js", bootstrap, topic)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    received = result["received"]
    assert [m["value"] for m in received] == ["gzip-3", "plain-1", "plain-2"]
    assert received[1] == {
        "partition": 0,
        "offset": "0",
        "key": "k1",
        "value": "plain-1",
        "headers": {"h": "v"},
    }
    assert received[0]["offset"] == "1"
    committed = {p["partition"]: p["offset"] for p in result["offsets"][0]["partitions"]}
    assert committed == {0: "2", 1: "1"}


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_kafkajs_group_rebalances(bootstrap: str, topic: str) -> None:
    done = run_node("kafka_group.js", bootstrap, topic)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = (set(p) for p in result["split"])
    assert first and second and not first & second and first | second == {0, 1, 2, 3}
    assert sorted(result["after"]) == [0, 1, 2, 3]
