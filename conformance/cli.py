"""``polymq conformance``: run the suite against a target and print (and write) the
table. Exit 0 when nothing failed or erred (known-missing features do not count),
1 otherwise, 2 for bad arguments."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from polymq.conformance import report
from polymq.conformance.cases import PROTOCOLS, cases_for
from polymq.conformance.profiles import PROFILES
from polymq.conformance.results import CaseResult, Outcome
from polymq.conformance.runner import DEFAULT_PORTS, Case, Target, run_cases
from polymq.gateway.progress import Progress

__all__ = ["build_parser", "main", "write_reports"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polymq conformance",
        description="Drive real clients of each protocol against a server and report "
        "which features behave as the specifications and reference brokers say.",
    )
    parser.add_argument("--target", default="127.0.0.1", help="host of the server under test")
    parser.add_argument(
        "--protocols",
        default=",".join(PROTOCOLS),
        help=f"comma-separated subset of {','.join(PROTOCOLS)}",
    )
    for protocol, port in DEFAULT_PORTS.items():
        parser.add_argument(f"--{protocol}-port", type=int, default=port, metavar="N")
    parser.add_argument("--user", help="user for Kafka SASL/PLAIN, AMQP and MQTT")
    parser.add_argument("--password")
    parser.add_argument("--access-key", help="access key for RocketMQ and MNS signatures")
    parser.add_argument("--secret-key")
    parser.add_argument("--vhost", default="/", help="AMQP virtual host")
    parser.add_argument(
        "--auth-enforced",
        action="store_true",
        help="the target checks credentials: also check that wrong ones are refused",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="polymq",
        help="kind of target; its known-missing features are reported as unsupported",
    )
    parser.add_argument(
        "--expect-missing",
        default="",
        metavar="FEATURE,...",
        help="more features (protocol.feature or feature) known missing on the target",
    )
    parser.add_argument(
        "--no-interop",
        action="store_true",
        help="skip the 5 x 5 interoperability matrix (run by default against polymq in "
        "open mode, over the protocols asked for; never against other profiles)",
    )
    parser.add_argument(
        "-k",
        dest="select",
        default="",
        help="only cases whose protocol.feature or client contains this",
    )
    parser.add_argument("--jobs", type=int, default=4, help="cases run at the same time")
    parser.add_argument(
        "--report", type=Path, metavar="FILE", help="also write FILE.md and FILE.html"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the raw results")
    parser.add_argument("--title", default="", help="title of the written reports")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    return parser


def write_reports(results: Sequence[CaseResult], base: Path, title: str) -> list[Path]:
    """Write ``base``.md and ``base``.html (an extension on ``base`` is replaced)."""
    base = base.with_suffix("") if base.suffix in (".md", ".html") else base
    md, page = base.with_name(base.name + ".md"), base.with_name(base.name + ".html")
    base.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(report.markdown(results, title))
    page.write_text(report.html_page(results, title))
    return [md, page]


def _wants_interop(args: argparse.Namespace, protocols: Sequence[str]) -> bool:
    """The matrix needs polymq (other brokers speak one protocol each), anonymous
    access (its drivers send no credentials) and at least two protocols."""
    return (
        not args.no_interop
        and not args.list
        and not args.select
        and args.profile == "polymq"
        and not args.auth_enforced
        and len(protocols) > 1
    )


def _interop(
    target: Target, protocols: Sequence[str], progress: Callable[[CaseResult], None]
) -> list[CaseResult]:
    """The matrix's cells; if it cannot run at all, one error row says why (the
    protocol rows already gathered still get reported)."""
    started = time.monotonic()
    try:
        from polymq.conformance.interop.matrix import run_matrix

        return run_matrix(target.host, target.ports, protocols=protocols, on_result=progress)
    except Exception as e:
        detail = f"the matrix did not run: {type(e).__name__}: {e}"
        seconds = time.monotonic() - started
        return [CaseResult("interop", "matrix", "", Outcome.ERROR, seconds, detail)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    try:
        cases = cases_for(protocols)
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    cases = [c for c in cases if args.select in f"{c.key} {c.client}"]
    if args.list:
        for c in cases:
            print(f"{c.key:40} {c.client:16} {c.doc}")
        return 0
    target = Target(
        host=args.target,
        ports={p: getattr(args, f"{p.replace('-', '_')}_port") for p in DEFAULT_PORTS},
        user=args.user,
        password=args.password,
        access_key=args.access_key,
        secret_key=args.secret_key,
        vhost=args.vhost,
        auth_enforced=args.auth_enforced,
    )
    missing = set(PROFILES[args.profile])
    missing |= {f.strip() for f in args.expect_missing.split(",") if f.strip()}

    interop = _wants_interop(args, protocols)
    # On a terminal: cases done, the one running, elapsed (gateway/progress.py); in CI
    # or a pipe only the results that are not ok, as lines that stay.
    with Progress(None if interop else len(cases), "conformance") as bar:

        def started(case: Case) -> None:
            bar.started(f"{case.protocol}.{case.feature} [{case.client}]")

        def progress(result: CaseResult) -> None:
            name = f"{result.protocol}.{result.feature} [{result.client}]"
            bar.finished(name)
            if not result.ok:
                bar.note(f"  {result.outcome.value:16} {name}")

        results = run_cases(
            cases,
            target,
            jobs=args.jobs,
            expect_missing=missing,
            on_result=progress,
            on_start=started,
        )
        if interop:
            results += _interop(target, protocols, progress)
    print(report.text_table(results))
    title = args.title or f"Conformance of {args.target} ({args.profile})"
    if args.report is not None:
        for path in write_reports(results, args.report, title):
            print(f"wrote {path}")
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
