"""Smoke test of bench/replication.py: a quick run over the merged form and the
replicated separated form (three NATS servers, three storage processes) prints its
tables, every message a client had acknowledged was consumed, and one takeover was
measured with nothing acknowledged lost. No figure is asserted beyond that: speeds
vary by machine. The two other forms are the same code with other process lists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORMS = ("merged", "separated-r3")


@pytest.mark.timeout(400)
def test_a_quick_run_prints_the_tables_and_consumes_every_acknowledged_message(
    tmp_path: Path,
) -> None:
    figures = tmp_path / "replication.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.replication",
            "--quick",
            "--forms",
            ",".join(FORMS),
            "--kills",
            "1",
            "--json",
            str(figures),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=390,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    out = done.stdout
    for heading in ("## Kafka", "## AMQP", "end-to-end latency", "ratios to", "## takeover"):
        assert heading in out, f"no {heading!r} in:\n{out}"
    report = json.loads(figures.read_text())
    for form in FORMS:
        label = report["meta"]["forms"][form]
        assert sum(line.startswith(label) for line in out.splitlines()) >= 4, (label, out)
        for protocol in ("kafka", "amqp"):
            row = report["figures"][form][protocol]
            assert row["acked"] > 0, (form, protocol, row)
            assert row["consumed"] == row["acked"], (form, protocol, row)
            for case, latency in row["latency"].items():
                assert latency["received"] > 0, (form, protocol, case, latency)
    takeover = report["takeover"]
    assert len(takeover["takeover_s"]) == 1, takeover
    assert takeover["acknowledged"] > 0, takeover
    assert takeover["lost"] == 0, takeover
