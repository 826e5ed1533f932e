"""The chaos bench's output: one table row per protocol, the kills by role, the
errors clients saw most; and the same figures as JSON for ``--json``."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.chaos_checker import Figures
from bench.chaos_history import History
from bench.chaos_killer import Kill, kill_downtime

__all__ = ["HEADER", "print_report", "write_histories", "write_json"]

HEADER = (
    "protocol   acked  delivered   lost  undeliv  redeliv  stored-dup  reordered"
    "  outage s  after kill        errors  reconn"
)


def _opt(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _row(f: Figures) -> str:
    return (
        f"{f.protocol:<9} {f.acknowledged:>6} {f.delivered:>10} {f.lost:>6} "
        f"{f.undelivered:>8} {f.redeliveries:>8} "
        f"{_opt(f.stored_duplicates):>11} {_opt(f.reordered):>10} "
        f"{f.longest_outage_s:>9.2f}  {f.outage_after_kill:<16} {f.errors:>6} {f.reconnects:>7}"
    )


def print_report(figures: Sequence[Figures], kills: Sequence[Kill], seconds: float) -> None:
    by_role = Counter(k.role for k in kills)
    downtimes = sorted(kill_downtime(k) for k in kills)
    print(f"\n## chaos: {len(kills)} kills in {seconds:.0f} s")
    print(HEADER)
    for f in figures:
        print(_row(f))
    roles = ", ".join(f"{role} {n}" for role, n in sorted(by_role.items())) or "none"
    print(f"\nkills by role: {roles}")
    if downtimes:
        print(
            f"down per kill (kill to ready again): median {downtimes[len(downtimes) // 2]:.1f} s,"
            f" max {downtimes[-1]:.1f} s"
        )
    failed = [k for k in kills if k.restart_failures]
    if failed:
        print("restarts that failed first: " + ", ".join(f"#{k.number} {k.name}" for k in failed))
    for f in figures:
        notes = []
        if f.lost:
            notes.append(f"LOST {f.lost}: {', '.join(f.lost_sample)}")
        if f.undelivered:
            notes.append(f"{f.undelivered} acknowledged, stored, never delivered to the consumer")
        if f.unconfirmed_delivered:
            notes.append(f"{f.unconfirmed_delivered} delivered that were never acknowledged")
        if f.stuck:
            notes.append(f"stuck: {'; '.join(f.stuck)}")
        if f.foreign:
            notes.append(f"{f.foreign} deliveries not sent by the bench")
        if f.top_errors:
            notes.append("errors: " + "; ".join(f"{n}x {kind}" for kind, n in f.top_errors))
        for note in notes:
            print(f"  {f.protocol}: {note}")


def write_json(
    path: Path, figures: Sequence[Figures], kills: Sequence[Kill], meta: dict[str, Any]
) -> None:
    document = {
        "meta": meta,
        "protocols": {f.protocol: dataclasses.asdict(f) for f in figures},
        "kills": [
            {
                "number": k.number,
                "name": k.name,
                "role": k.role,
                "down_s": round(kill_downtime(k), 3),
                "restart_failures": k.restart_failures,
            }
            for k in kills
        ],
        "kills_by_role": dict(Counter(k.role for k in kills)),
        "lost": sum(f.lost for f in figures),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_histories(
    path: Path, histories: Sequence[History], kills: Sequence[Kill], origin: float
) -> None:
    """Every acknowledgement, delivery and kill, one JSON line each, times in seconds
    since the run began: for finding out what happened around one figure."""
    with path.open("w") as out:
        for k in kills:
            line = {"kill": k.number, "name": k.name, "at": round(k.killed_at - origin, 3)}
            if k.restarted_at is not None:
                line["ready"] = round(k.restarted_at - origin, 3)
            out.write(json.dumps(line) + "\n")
        for h in histories:
            acked, deliveries = h.snapshot()
            for (producer, seq), at in acked.items():
                line = {"p": h.protocol, "acked": f"{producer}/{seq}", "at": round(at - origin, 3)}
                out.write(json.dumps(line) + "\n")
            for d in deliveries:
                line = {
                    "p": h.protocol,
                    "delivered": f"{d.producer}/{d.seq}",
                    "at": round(d.at - origin, 3),
                    "queue": d.queue,
                    "stored_at": d.stored_at,
                    "redelivered": d.redelivered,
                }
                out.write(json.dumps(line) + "\n")
