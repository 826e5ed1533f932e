"""Runs a node client script (``tests/nodejs/conformance_*.js``) for a case: the node
clients live with the repository's tests, where ``npm ci`` installs them. Without node
or those modules the case is not applicable rather than failed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from polymq.conformance.runner import NotApplicable

__all__ = ["run_node"]

NODE_DIR = Path(__file__).resolve().parents[2] / "tests" / "nodejs"


def run_node(script: str, *args: str, timeout: float = 45.0) -> dict[str, Any]:
    """The JSON object the script prints last; AssertionError with its stderr if it
    exits non-zero."""
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules").is_dir():
        raise NotApplicable("node or tests/nodejs/node_modules is not installed")
    done = subprocess.run(
        [node, str(NODE_DIR / script), *args],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"{script} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{script} printed no result: {done.stdout[-400:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result
