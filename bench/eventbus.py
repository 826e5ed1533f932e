"""Rule matching benchmark: events/s through the event bus's rule index against
10 / 1,000 / 10,000 rules, and the same events through a plain pass over every rule
for comparison (the cost the index avoids).

The rules are a realistic mix: 70 % match on an exact ``type`` (one of 2,000 event
types) plus a field of ``data``, 20 % on an exact ``data.region`` plus a numeric range,
8 % on a prefix or a suffix (an ``$or`` of both), 2 % on a numeric range only: those
have no literal, prefix or suffix to be found by and are matched against every event.
Pure CPU, in this process: no server.

    .venv/bin/python -m bench.eventbus            # a few seconds
    .venv/bin/python -m bench.eventbus --quick
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from polymq.protocols.eventbus.patterns import Pattern, compile_pattern
from polymq.protocols.eventbus.rule_index import RuleIndex

TYPES = 2_000
REGIONS = 50


def make_rules(count: int, rng: random.Random) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for i in range(count):
        kind = i % 10
        if kind < 7:
            rules.append(
                {
                    "type": [f"com.example.t{rng.randrange(TYPES)}"],
                    "data": {"status": [rng.choice(["ok", "failed"]), {"prefix": "warn"}]},
                }
            )
        elif kind < 9:
            rules.append(
                {
                    "data": {
                        "region": [f"r{rng.randrange(REGIONS)}"],
                        "amount": [{"numeric": [">", rng.randrange(1000)]}],
                    }
                }
            )
        elif i % 50 != 49:
            rules.append(
                {
                    "$or": [
                        {"source": [{"prefix": f"/app/{rng.randrange(100)}/"}]},
                        {"subject": [{"suffix": f".{rng.randrange(100)}"}]},
                    ]
                }
            )
        else:
            rules.append({"data": {"amount": [{"numeric": [">", rng.randrange(2000)]}]}})
    return rules


def make_events(count: int, rng: random.Random) -> list[dict[str, Any]]:
    return [
        {
            "specversion": "1.0",
            "id": str(i),
            "source": f"/app/{rng.randrange(200)}/x",
            "type": f"com.example.t{rng.randrange(TYPES)}",
            "subject": f"order.{rng.randrange(300)}",
            "data": {
                "status": rng.choice(["ok", "failed", "warning"]),
                "region": f"r{rng.randrange(REGIONS * 2)}",
                "amount": rng.randrange(2000),
            },
        }
        for i in range(count)
    ]


def rate(fn: Any, events: list[dict[str, Any]], budget_s: float) -> tuple[float, int]:
    """events/s of ``fn`` over ``events`` (repeated until ``budget_s``), and matches."""
    done = matched = 0
    start = time.perf_counter()
    while True:
        for event in events:
            matched += len(fn(event))
        done += len(events)
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return done / elapsed, matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    rng = random.Random(20)
    budget = 0.3 if args.quick else 2.0
    events = make_events(2_000, rng)
    print(
        f"{'rules':>7} {'scanned':>8} {'indexed ev/s':>13} {'full pass ev/s':>15} {'speed-up':>9}"
    )
    for count in (10, 1_000, 10_000):
        compiled: list[tuple[Pattern, int]] = [
            (compile_pattern(p), i) for i, p in enumerate(make_rules(count, rng))
        ]
        index = RuleIndex(compiled)

        def full_pass(
            event: dict[str, Any], compiled: list[tuple[Pattern, int]] = compiled
        ) -> list[int]:
            return [i for p, i in compiled if p.matches(event)]

        indexed, hits = rate(index.match, events, budget)
        # The full pass is slow at 10,000 rules: fewer events for it.
        sample = events if count <= 1_000 else events[:200]
        plain, _ = rate(full_pass, sample, budget)
        print(
            f"{count:>7} {index.scanned:>8} {indexed:>13,.0f} {plain:>15,.0f} "
            f"{indexed / plain:>8.1f}x"
        )
        assert hits >= 0


if __name__ == "__main__":
    main()
