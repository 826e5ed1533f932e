"""``python -m tests.netfuzz --seconds 60 --form merged|cluster|both [--protocol P ...]
[--seed N]``: fuzz live servers and print, per protocol, what was sent, what the
server did, and the findings; exit code 1 when anything crashed, hung or leaked."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from tests.netfuzz.report import render
from tests.netfuzz.runner import MIB, FormReport, Settings, fuzz_form
from tests.netfuzz.seeds import PROTOCOLS, REGRESSIONS, SESSIONS, load_dir
from tests.netfuzz.servers import FORMS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.netfuzz", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="fuzzing time per form [60]")
    parser.add_argument("--count", type=int, help="stop after this many mutated connections")
    parser.add_argument("--form", choices=(*FORMS, "both"), default="both", help="[both]")
    parser.add_argument("--protocol", action="append", choices=PROTOCOLS, help="[all]")
    parser.add_argument("--seed", type=int, default=1, help="[1]")
    parser.add_argument("--concurrency", type=int, default=2, help="per protocol [2]")
    parser.add_argument("--stall-seconds", type=float, default=3.0, help="[3]")
    parser.add_argument("--max-rss-growth-mib", type=int, default=128, help="[128]")
    default_findings = Path(tempfile.gettempdir()) / "netfuzz-findings"
    parser.add_argument(
        "--findings",
        type=Path,
        default=default_findings,
        help=f"where inputs of findings are written [{default_findings}]",
    )
    parser.add_argument(
        "--no-regressions", action="store_true", help="skip replaying tests/netfuzz/regressions"
    )
    args = parser.parse_args(argv)
    protocols = tuple(args.protocol or PROTOCOLS)
    settings = Settings(
        seconds=args.seconds,
        count=args.count,
        seed=args.seed,
        protocols=protocols,
        concurrency=args.concurrency,
        stall_s=args.stall_seconds,
        max_rss_growth_bytes=args.max_rss_growth_mib * MIB,
        regressions={} if args.no_regressions else load_dir(REGRESSIONS, protocols),
        findings_dir=args.findings,
    )
    seeds = load_dir(SESSIONS, protocols)
    reports: list[FormReport] = []
    for form in FORMS if args.form == "both" else (args.form,):
        report = asyncio.run(fuzz_form(form, seeds, settings))
        print(render(report, settings), flush=True)
        reports.append(report)
    return 1 if any(r.fatal() or any(not x.ok for x in r.regressions) for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
