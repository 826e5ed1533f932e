"""The fuzz targets in CI: every regression input replays cleanly through its target,
and a short fuzz of every target finds nothing.

Both run each target in a subprocess of its own (a finding may abort the process, and
libFuzzer exits on the first one), with an address-space limit so that an input that
bloats fails with ``MemoryError`` instead of swapping the machine.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fuzz.runner import REGRESSIONS, ROOT, fuzz_target
from tests.fuzz.targets import TARGETS

SHORT_FUZZ_SECONDS = 5
REPLAY_TIMEOUT_S = 60
ADDRESS_SPACE_BYTES = 4 << 30

# Targets whose codec another engineer is still fixing (issue 14): lead, drop these marks
# as the fixes land. Empty when every target passes.
BEING_FIXED: dict[str, str] = {}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def _regressions() -> list[Any]:
    cases: list[Any] = []
    for target in TARGETS:
        folder = REGRESSIONS / target
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            marks: list[pytest.MarkDecorator] = []
            if target in BEING_FIXED:
                marks.append(pytest.mark.xfail(strict=False, reason=BEING_FIXED[target]))
            cases.append(pytest.param(target, path, id=f"{target}/{path.name}", marks=marks))
    return cases


def _marked(target: str) -> Any:
    marks: list[pytest.MarkDecorator] = []
    if target in BEING_FIXED:
        marks.append(pytest.mark.xfail(strict=False, reason=BEING_FIXED[target]))
    return pytest.param(target, id=target, marks=marks)


@pytest.mark.timeout(REPLAY_TIMEOUT_S + 30)
@pytest.mark.parametrize(("target", "path"), _regressions())
def test_regression_input_replays_cleanly(target: str, path: Path) -> None:
    """One finding each: the input that once crashed, hung or bloated its target."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.worker", target, "--replay", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=REPLAY_TIMEOUT_S,
        preexec_fn=_limit_memory,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"


@pytest.mark.timeout(SHORT_FUZZ_SECONDS * 4 + 90)
@pytest.mark.parametrize("target", [_marked(target) for target in TARGETS])
def test_short_fuzz_finds_nothing(target: str, tmp_path: Path) -> None:
    report = fuzz_target(target, seconds=SHORT_FUZZ_SECONDS, runs=None, scratch=tmp_path)
    print(f"{target}: {report.executed} inputs, cov {report.coverage}")
    assert report.executed > 0, (tmp_path / "libfuzzer-0.log").read_text()[-4000:]
    # Guided means instrumented: with no coverage (the codec's package not named for
    # instrumentation) libFuzzer only mutates blindly.
    assert report.coverage > 10, f"{target}: cov {report.coverage}: is its package instrumented?"
    assert not report.findings, "\n\n".join(
        f"{f.kind}: {f.summary}\ninput: {f.artifact}\n{f.log}" for f in report.findings
    )
