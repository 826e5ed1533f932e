"""Smoke test of bench/storage.py: a quick run prints every expected row, each with
positive figures. No assertion on speed (wall-clock figures vary by machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "storage.py"
SIZES = (100, 4096)
DURABILITIES = ("sync", "async")

POSITIVE_ROW_FIELDS = (
    "calls",
    "msgs",
    "seconds",
    "msgs_per_s",
    "calls_per_s",
    "mb_per_s",
    "msgs_per_call",
    "p50_ms",
    "p99_ms",
    "cpu_seconds",
    "cpu_us_per_msg",
)


def expected_keys() -> set[str]:
    keys = set()
    for body in SIZES:
        for case in ("write+fdatasync", "write only"):
            for per_write in (1, 100):
                keys.add(f"disk/{case} {per_write}x/{body}/-/c1")
        for case, concurrency in (
            ("1 req", 1),
            ("1 req", 64),
            ("100 req", 1),
            ("100 req", 8),
            ("entry x100", 1),
            ("entry x100", 8),
        ):
            for durability in DURABILITIES:
                keys.add(f"append/{case}/{body}/{durability}/c{concurrency}")
        for case in ("read msgs", "read entries", "read_batches msgs", "read_batches entries"):
            keys.add(f"read/{case}/{body}/-/c1")
        for durability in DURABILITIES:
            for concurrency in (1, 8):
                for how in ("ack", "ack_many"):
                    keys.add(f"pop/pop32+{how}/{body}/{durability}/c{concurrency}")
        keys.add(f"pop/woken pop1+ack/{body}/-/c1")
    return keys


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.timeout(300)
def test_every_throughput_row_is_there_with_positive_figures(report: dict[str, Any]) -> None:
    rows = {row["key"]: row for row in report["rows"]}
    assert len(rows) == len(report["rows"]), "row keys are not unique"
    missing = expected_keys() - rows.keys()
    assert not missing, f"missing rows: {sorted(missing)}"
    for key in expected_keys():
        row = rows[key]
        for name in POSITIVE_ROW_FIELDS:
            assert row[name] > 0, f"{key}: {name} = {row[name]}"
        assert row["stop"] in ("count", "time", "data"), key
        if row["section"] == "append":
            assert row["log_bytes_per_msg"] >= row["body_bytes"], key


@pytest.mark.timeout(300)
def test_memory_rows_are_there_with_positive_figures(report: dict[str, Any]) -> None:
    by_phase: dict[tuple[str, str], dict[str, Any]] = {}
    for row in report["memory"]:
        kind = "msgs" if "msgs" in row["case"] else "queues"
        by_phase.setdefault((kind, row["phase"]), row)
    wanted = [
        ("msgs", "write"),
        ("msgs", "reopen (checkpoint)"),
        ("msgs", "reopen (log replay)"),
        ("queues", "create"),
        ("queues", "reopen (checkpoint)"),
    ]
    for kind, phase in wanted:
        assert (kind, phase) in by_phase, f"no {kind} {phase} row"
    queue_shapes = {r["case"] for r in report["memory"] if "queues" in r["case"]}
    assert len(queue_shapes) == 2, queue_shapes
    for row in report["memory"]:
        assert row["error"] is None, f"{row['key']}: {row['error']}"
        for name in ("items", "seconds", "items_per_s", "rss_before_mb", "rss_after_mb"):
            assert row[name] > 0, f"{row['key']}: {name} = {row[name]}"


@pytest.mark.timeout(300)
def test_meta_and_cleanup(report: dict[str, Any]) -> None:
    meta = report["meta"]
    assert meta["mode"] == "quick"
    assert meta["run_seconds"] > 0
    assert not Path(meta["tmp_path"]).exists(), "the temporary directory was left behind"
