"""Side-by-side table of several runs' JSON results (``polymq conformance --json``):

python -m conformance.compare OUT.md polymq=polymq.json rabbitmq=rabbitmq.json ...
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from polymq.conformance.report import comparison_markdown
from polymq.conformance.results import CaseResult, Outcome

__all__ = ["load_results", "main"]


def load_results(path: Path) -> list[CaseResult]:
    rows = json.loads(path.read_text())
    return [CaseResult(**{**row, "outcome": Outcome(row["outcome"])}) for row in rows]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or any("=" not in a for a in args[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    targets = {name: load_results(Path(path)) for name, path in (a.split("=", 1) for a in args[1:])}
    Path(args[0]).write_text(comparison_markdown(targets))
    print(f"wrote {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
