"""Smoke test of bench/workers.py: a short run over 1 and 2 workers prints a table
row for each with positive figures, and writes every round to --json. Nothing about
speed is asserted (figures vary by machine and by who else uses it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ONE_FORM = True  # the bench starts its own servers

ROOT = Path(__file__).resolve().parents[2]


def test_bench_prints_a_row_per_worker_count(tmp_path: Path) -> None:
    out = tmp_path / "rounds.json"
    argv = [sys.executable, "-m", "bench.workers", "--rounds", "1", "--seconds", "1"]
    argv += ["--workers", "1,2", "--cases", "mns", "--clients", "2", "--json", str(out)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| mns |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"]
    rounds = json.loads(out.read_text())
    assert [r["workers"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["msgs"] > 0 and r["server_cpu_s"] > 0 and r["parent_cpu_s"] > 0
