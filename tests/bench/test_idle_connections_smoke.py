"""Smoke test of bench/idle_connections.py over ``--workers 2``: the connections are
opened and held, every server process is counted (the workers listen, the parent
does not), the kernel spread them over both workers, and a real client was served
meanwhile. No memory figure is asserted: it varies with the machine and the count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONNECTIONS = 300


@pytest.mark.timeout(240)
def test_a_small_run_over_two_workers_holds_every_connection() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.idle_connections", "--workers", "2"),
            *("--connections", str(CONNECTIONS), "--waves", "1"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["connections"] == CONNECTIONS and row["failed"] == 0, row
    assert row["workers"] == 2 and row["paho_served_meanwhile"] is True, row
    held = row["connections_per_worker"]
    assert len(held) == 2 and all(n > 0 for n in held), row
    assert CONNECTIONS - 2 <= sum(held) <= CONNECTIONS, row
    assert row["server_rss_after_mib"] > row["server_rss_before_mib"] > 0, row
