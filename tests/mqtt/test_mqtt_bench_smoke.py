"""bench/mqtt.py still runs: a --quick run prints every scenario with figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_prints_every_scenario() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.mqtt", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    by_name = {row["scenario"]: row for row in rows}
    for name in (
        "publish qos0",
        "publish qos1",
        "publish qos1, persistent subscriber",
        "fan-in 20->1",
        "fan-out 1->100",
    ):
        assert by_name[name]["delivered"] > 0 and by_name[name]["msgs_per_s"] > 0
    assert by_name["latency at 1000/s"]["samples"] > 0
    assert by_name["idle connections"]["connections"] == 50
    assert by_name["topic index"]["matches_per_s"] > 0
