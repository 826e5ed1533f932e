"""Runs fuzz targets, each in a subprocess of its own, and reports what libFuzzer saw.

``python -m tests.fuzz [--seconds-per-target S | --runs N] [--save-crashes] [target ...]``

Each target starts from a temporary copy of its committed corpus (so the committed
corpus never grows by itself) plus its regression inputs, and writes crash artifacts to
a temporary folder; ``--save-crashes`` copies them into
``tests/fuzz/regressions/<target>/``, where ``test_fuzz.py`` replays them from then on.

libFuzzer stops at its first finding. With ``--keep-going K`` the runner starts the
target again on the same (grown) working corpus, up to ``K`` more times, while budget
is left, so one run reports more than one finding per target.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.fuzz.targets import TARGETS
from tests.fuzz.worker import IGNORE_ENV

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = HERE / "corpus"
REGRESSIONS = HERE / "regressions"

RSS_LIMIT_MB = 2048
TIMEOUT_S = 10  # libFuzzer's per-input limit: slower than this is a hang
_ARTIFACT = re.compile(r"Test unit written to (\S+)")
_KINDS = (
    ("Uncaught Python exception", "exception"),
    ("libFuzzer: timeout", "timeout"),
    ("libFuzzer: out-of-memory", "out-of-memory"),
    ("libFuzzer: deadly signal", "deadly signal"),
    ("libFuzzer: fuzz target exited", "exit"),
)
_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+)", re.MULTILINE)
_STAT = re.compile(r"^stat::(\w+):\s+(\d+)", re.MULTILINE)
_NOT_ERRORS = ("Traceback", "During handling", "The above exception", "finding signature", "==")
_SIGNATURE = re.compile(r"^finding signature: (\S+)", re.MULTILINE)


@dataclass(slots=True)
class Finding:
    kind: str
    signature: str  # worker.signature() for an exception, else the summary
    summary: str  # the exception's last line, or libFuzzer's error line
    artifact: Path | None
    log: str  # the report's text: traceback, libFuzzer's lines


@dataclass(slots=True)
class Report:
    target: str
    executed: int = 0
    seconds: float = 0.0
    coverage: int = 0
    features: int = 0
    corpus: int = 0
    peak_rss_mb: int = 0
    findings: list[Finding] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def exec_per_s(self) -> float:
        return self.executed / self.seconds if self.seconds else 0.0


def parse(output: str, artifacts: Path) -> tuple[dict[str, int], tuple[int, int], Finding | None]:
    """libFuzzer's final stats, the last coverage it printed, and its finding if any."""
    stats = {name: int(value) for name, value in _STAT.findall(output)}
    statuses = _STATUS.findall(output)
    if statuses:
        stats.setdefault("number_of_executed_units", int(statuses[-1][0]))
        coverage = (int(statuses[-1][1]), int(statuses[-1][2]))
    else:
        coverage = (0, 0)
    kind = next((name for marker, name in _KINDS if marker in output), None)
    if kind is None:
        return stats, coverage, None
    written = _ARTIFACT.findall(output)
    artifact = Path(written[-1]) if written else None
    if artifact is not None and not artifact.is_absolute():
        artifact = artifacts.parent / artifact
    summary = _summary(output, kind)
    signatures = _SIGNATURE.findall(output)
    signature = signatures[-1] if signatures and kind == "exception" else summary
    return stats, coverage, Finding(kind, signature, summary, artifact, _excerpt(output))


def _summary(output: str, kind: str) -> str:
    lines = output.splitlines()
    if kind == "exception":  # the traceback's last unindented line names the error
        start = next(i for i, line in enumerate(lines) if "Uncaught Python exception" in line)
        last = None
        for line in lines[start + 1 :]:
            if "ERROR: libFuzzer" in line or line.startswith("MS:"):
                break
            if line and not line[0].isspace() and not line.startswith(_NOT_ERRORS):
                last = line
        if last is not None:
            return last.strip()[:300]
    for line in lines:  # an abort from native code says why before dying
        if "memory allocation" in line or "panicked" in line:
            return line.strip()[:300]
    for line in lines:
        if "ERROR: libFuzzer" in line:
            return line.split("ERROR: ", 1)[1].strip()[:300]
    return kind


def _excerpt(output: str) -> str:
    lines = output.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if any(marker in line for marker, _ in _KINDS)),
        max(0, len(lines) - 40),
    )
    return "\n".join(lines[max(0, start - 3) : start + 60])


def _seed(work: Path, target: str) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for folder in (CORPUS / target, REGRESSIONS / target):
        if folder.is_dir():
            for path in folder.iterdir():
                if path.is_file() and not path.name.startswith("."):
                    shutil.copy(path, work / f"{folder.name}-{path.name}")


def fuzz_target(
    target: str,
    *,
    seconds: float | None,
    runs: int | None,
    keep_going: int = 0,
    scratch: Path,
    extra_flags: Sequence[str] = (),
    python: str = sys.executable,
) -> Report:
    """Fuzz ``target`` for ``seconds`` (or ``runs`` inputs) in a subprocess."""
    spec = TARGETS[target]
    work, artifacts = scratch / "corpus", scratch / "artifacts"
    _seed(work, target)
    artifacts.mkdir(parents=True, exist_ok=True)
    report = Report(target)
    started = time.monotonic()
    for attempt in range(keep_going + 1):
        flags = [
            f"-max_len={spec.max_len}",
            f"-rss_limit_mb={RSS_LIMIT_MB}",
            f"-timeout={TIMEOUT_S}",
            "-print_final_stats=1",
            f"-artifact_prefix={artifacts}/",
            *extra_flags,
        ]
        if seconds is not None:
            left = seconds - (time.monotonic() - started)
            if attempt and left < 1:
                break
            flags.append(f"-max_total_time={max(1, int(left))}")
        if runs is not None:
            left_runs = runs - report.executed
            if attempt and left_runs <= 0:
                break
            flags.append(f"-runs={left_runs}")
        log = scratch / f"libfuzzer-{attempt}.log"
        known = sorted({finding.signature for finding in report.findings})
        env = dict(os.environ, PYTHONHASHSEED="0", **{IGNORE_ENV: json.dumps(known)})
        begun = time.monotonic()
        with log.open("w") as out:
            subprocess.run(
                [python, "-m", "tests.fuzz.worker", target, str(work), *flags],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=(seconds or 3600) + 120,
                check=False,
            )
        report.seconds += time.monotonic() - begun
        report.logs.append(log)
        stats, (cov, ft), finding = parse(log.read_text(errors="replace"), artifacts)
        report.executed += stats.get("number_of_executed_units", 0)
        report.peak_rss_mb = max(report.peak_rss_mb, stats.get("peak_rss_mb", 0))
        report.coverage = max(report.coverage, cov)
        report.features = max(report.features, ft)
        if finding is None:
            break
        report.findings.append(finding)
    report.corpus = sum(1 for _ in work.iterdir())
    return report


def save(finding: Finding, target: str) -> Path | None:
    if finding.artifact is None or not finding.artifact.exists():
        return None
    folder = REGRESSIONS / target
    folder.mkdir(parents=True, exist_ok=True)
    destination = folder / finding.artifact.name
    shutil.copy(finding.artifact, destination)
    return destination


def print_report(report: Report, *, saved: dict[int, Path]) -> None:
    status = f"{len(report.findings)} finding(s)" if report.findings else "no finding"
    print(
        f"{report.target:18} inputs {report.executed:>10,}  exec/s {report.exec_per_s:>8,.0f}  "
        f"cov {report.coverage:>5} ft {report.features:>6}  corpus {report.corpus:>5}  "
        f"rss {report.peak_rss_mb:>5} MB  {status}",
        flush=True,
    )
    for number, finding in enumerate(report.findings):
        where = saved.get(number) or finding.artifact
        print(
            f"    {finding.kind}: {finding.summary}\n      at {finding.signature}\n"
            f"      input: {where}",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--seconds-per-target", type=float, default=None, metavar="S")
    budget.add_argument("--runs", type=int, default=None, metavar="N", help="inputs per target")
    parser.add_argument("--save-crashes", action="store_true", help="copy findings to regressions/")
    parser.add_argument(
        "--keep-going", type=int, default=0, metavar="K", help="restarts per target"
    )
    parser.add_argument("--verbose", action="store_true", help="print each finding's report")
    parser.add_argument("--keep-scratch", action="store_true", help="keep the working folders")
    parser.add_argument("targets", nargs="*", metavar="target", help=", ".join(TARGETS))
    args = parser.parse_args(argv)
    unknown = [name for name in args.targets if name not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    seconds = args.seconds_per_target
    if seconds is None and args.runs is None:
        seconds = 60.0
    found = 0
    for target in args.targets or list(TARGETS):
        scratch = Path(tempfile.mkdtemp(prefix=f"polymq-fuzz-{target}-"))
        report = fuzz_target(
            target, seconds=seconds, runs=args.runs, keep_going=args.keep_going, scratch=scratch
        )
        saved: dict[int, Path] = {}
        if args.save_crashes:
            for number, finding in enumerate(report.findings):
                path = save(finding, target)
                if path is not None:
                    saved[number] = path
        print_report(report, saved=saved)
        if args.verbose:
            for finding in report.findings:
                print(finding.log, flush=True)
        found += len(report.findings)
        if args.keep_scratch or (report.findings and not args.save_crashes):
            print(f"    working folder kept: {scratch}", flush=True)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 1 if found else 0
