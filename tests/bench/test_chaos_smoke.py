"""Smoke test of bench/chaos.py: a short run of the real thing (the separated form as
processes, every protocol's real client, three SIGKILLs with restarts) ends with the
checker's table, and nothing acknowledged was lost, which is the product's promise.
No figure but ``lost`` is asserted: outages and redeliveries vary by machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.chaos_report import HEADER  # noqa: E402

PROTOCOLS = ("kafka", "amqp", "mqtt", "rocketmq", "mns")


@pytest.mark.timeout(240)
def test_a_short_chaos_run_prints_the_table_and_loses_nothing(tmp_path: Path) -> None:
    figures = tmp_path / "chaos.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.chaos",
            "--kills",
            "3",
            "--interval",
            "1-2",
            "--downtime",
            "0.5-1",
            "--drain-seconds",
            "30",
            "--audit-seconds",
            "35",
            "--json",
            str(figures),
            "--log-file",
            str(tmp_path / "chaos.log"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=230,
        check=False,
    )
    assert HEADER in done.stdout, f"no table:\n{done.stdout}\n{done.stderr[-3000:]}"
    report = json.loads(figures.read_text())
    assert report["meta"]["aborted"] is None, report["meta"]
    assert len(report["kills"]) == 3
    assert sum(report["kills_by_role"].values()) == 3
    for protocol in PROTOCOLS:
        row = report["protocols"][protocol]
        assert row["acknowledged"] > 0, f"{protocol}: nothing acknowledged"
        assert row["delivered"] > 0, f"{protocol}: nothing delivered"
        assert any(line.startswith(protocol) for line in done.stdout.splitlines()), protocol
    lost = {
        p: report["protocols"][p]["lost_sample"]
        for p in PROTOCOLS
        if report["protocols"][p]["lost"]
    }
    assert not lost, f"acknowledged and lost: {lost}\n{done.stdout}"
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
