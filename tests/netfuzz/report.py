"""The fuzzer's report as text: one table row per protocol, then memory, findings,
regressions and the tracebacks the server logged."""

from __future__ import annotations

from tests.netfuzz.runner import MIB, FormReport, Settings
from tests.netfuzz.seeds import PROTOCOLS

__all__ = ["render"]


def render(report: FormReport, settings: Settings) -> str:
    lines = [
        f"== netfuzz {report.form}: {report.seconds:.0f} s, seed {settings.seed}, "
        f"{report.restarts} restart(s)",
        f"{'protocol':<9} {'replayed':>8} {'mutations':>9} {'closed':>7} {'refused':>7} "
        f"{'slow':>5} {'findings':>8} {'probe rt':>8} {'worst ms':>8} {'probe fail':>10}",
    ]
    for protocol in PROTOCOLS:
        s = report.stats.get(protocol)
        p = report.probes.get(protocol)
        findings = len(report.fatal(protocol))
        lines.append(
            f"{protocol:<9} {s.replayed if s else 0:>8} {s.mutations if s else 0:>9} "
            f"{s.closed_by_server if s else 0:>7} {s.refused if s else 0:>7} "
            f"{s.slow if s else 0:>5} {findings:>8} {p.round_trips if p else 0:>8} "
            f"{(p.worst_s * 1000 if p else 0):>8.0f} {p.failures if p else 0:>10}"
        )
    lines.append("memory (RSS, MiB): baseline / peak / end / growth after the fuzz connections")
    for name, base in report.rss_baseline.items():
        peak = report.rss_peak.get(name, base)
        end = report.rss_end.get(name)
        end_text = f"{end / MIB:.0f} / {(end - base) / MIB:+.0f}" if end else "- / -"
        lines.append(f"  {name:<12} {base / MIB:.0f} / {peak / MIB:.0f} / {end_text}")
    if report.regressions:
        lines.append("regressions:")
        for r in report.regressions:
            lines.append(f"  {'ok  ' if r.ok else 'FAIL'} {r.protocol}/{r.name}: {r.detail}")
    lines.append(f"findings: {len(report.findings)}")
    for f in report.findings:
        lines.append(f"  [{f.kind}] {f.protocol}: {f.detail}")
        for plan in f.inputs[:4]:
            lines.append(f"      input {plan.protocol} {plan.description[:160]}")
            # Enough to recognise it from a CI log, where the saved file is not at hand.
            lines.append(f"        first bytes {plan.data[:48].hex()} ({len(plan.data)} in all)")
        if len(f.inputs) > 4:
            lines.append(f"      ... {len(f.inputs) - 4} more input(s)")
        for path in f.saved[:4]:
            lines.append(f"      saved {path}")
        if f.log:
            lines.append("      the server's log:")
        for log in f.log[-12:]:
            lines.append(f"      log | {log[:300]}")
    if report.tracebacks:
        lines.append("tracebacks the server logged (protocol, exception at first own frame):")
        for (protocol, where), count in report.tracebacks.most_common():
            lines.append(f"  {count:>5} {protocol}: {where}")
    return "\n".join(lines)
