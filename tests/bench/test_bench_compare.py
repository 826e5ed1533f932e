"""Smoke test of ``make bench-compare``'s plumbing (bench/compare.py --quick): polymq
and the reference brokers that are installed (Mosquitto, RabbitMQ from Debian's
packages; CI installs neither, so there it skips) are started, every case runs against
both, the table has each row of those protocols with a ratio, and no broker is left
running. No assertion on any figure's size: the machine is shared."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(ROOT))

from bench._reference import mosquitto_installed, rabbitmq_installed  # noqa: E402
from bench.compare import CASES, ROWS  # noqa: E402

RATIO = re.compile(r"^\d+\.\d+\N{MULTIPLICATION SIGN}( / \d+\.\d+\N{MULTIPLICATION SIGN})?$")


def _installed() -> list[str]:
    return [
        protocol
        for protocol, installed in (("mqtt", mosquitto_installed), ("amqp", rabbitmq_installed))
        if installed()
    ]


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def test_quick_comparison_prints_every_row_with_a_ratio(tmp_path: Path) -> None:
    protocols = _installed()
    if not protocols:
        pytest.skip(
            "neither Mosquitto nor RabbitMQ is installed (make bench-compare installs them)"
        )
    out = tmp_path / "compare.json"
    command = [sys.executable, "-m", "bench.compare", "--quick", "--json", str(out)]
    result = subprocess.run(
        [*command, "--protocols", ",".join(protocols)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    protocol_of = {case.key: case.protocol for case in CASES}
    wanted = [label for label, key, _ in ROWS if protocol_of[key] in protocols]
    rows = {row["case"]: row for row in data["rows"]}
    assert list(rows) == wanted
    for label, row in rows.items():
        assert RATIO.match(row["ratio"]), (label, row)
        assert RATIO.match(row["cpu_ratio"]), (label, row)  # nanosecond CPU: never 0
        assert "n/a" not in row["polymq"] and "n/a" not in row["reference"], (label, row)
        assert f"| {label} |" in result.stdout
    assert not data["errors"]
    assert len(data["pids"]) == 2 * len(protocols)
    assert all(_gone(pid) for pid in data["pids"].values()), data["pids"]
