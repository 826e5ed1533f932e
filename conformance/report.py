"""Results -> a text table, Markdown and an HTML page. Pure: no I/O, so the same
results (ours, a reference broker's, the interop matrix's) always render the same.

The HTML page draws each protocol as a matrix, features down and clients across; the
interop results (``protocol="interop"``, ``feature="<producer> -> <consumer>"``) become
the producer x consumer grid. Cells are coloured by outcome.
"""

from __future__ import annotations

import collections
import html
from collections.abc import Iterable, Mapping, Sequence

from polymq.conformance.results import CaseResult, Outcome

__all__ = ["comparison_markdown", "html_page", "markdown", "summary", "text_table"]

_HEADERS = ("protocol", "feature", "client", "result", "time")
_COLOURS = {
    Outcome.PASS: "#b7e1b0",
    Outcome.FAIL: "#f4a6a6",
    Outcome.UNSUPPORTED: "#d9d9d9",
    Outcome.ERROR: "#f6d28b",
}
_INTEROP = "interop"
_ARROW = " -> "


def _row(result: CaseResult) -> tuple[str, str, str, str, str]:
    return (
        result.protocol,
        result.feature,
        result.client,
        result.outcome.value,
        f"{result.seconds:.2f}s",
    )


def _notes(results: Iterable[CaseResult]) -> list[str]:
    """Why each row that did not pass did not."""
    return [
        f"{r.protocol} / {r.feature} / {r.client}: {r.outcome.value}: {r.detail}"
        for r in results
        if r.detail and r.outcome is not Outcome.PASS
    ]


def summary(results: Iterable[CaseResult]) -> str:
    """``12 pass, 1 fail, 2 skip-unsupported, 0 error`` (every outcome named)."""
    counts = collections.Counter(r.outcome for r in results)
    return ", ".join(f"{counts[o]} {o.value}" for o in Outcome)


def text_table(results: Sequence[CaseResult], *, details: bool = True) -> str:
    """A fixed-width table for a terminal; with ``details``, the reason of every row
    that did not pass is listed under it."""
    rows = [_HEADERS, *(_row(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADERS))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = [*lines, "", summary(results)]
    if details:
        notes = [f"- {note}" for note in _notes(results)]
        if notes:
            out += ["", *notes]
    return "\n".join(out) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: Sequence[CaseResult], title: str = "Conformance") -> str:
    """A Markdown report: the summary, one table of every row, then the reasons."""
    out = [f"# {title}", "", summary(results), "", "| " + " | ".join(_HEADERS) + " | detail |"]
    out.append("|" + "---|" * (len(_HEADERS) + 1))
    for r in results:
        cells = (*_row(r), r.detail if r.outcome is not Outcome.PASS else "")
        out.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def _grid(
    results: Sequence[CaseResult],
) -> tuple[list[str], list[str], dict[tuple[str, str], CaseResult]]:
    """Rows, columns and cells of one protocol's matrix, in first-seen order. The
    interop matrix is square, the same protocols down and across, so its diagonal
    (a protocol to itself) lines up."""
    rows: dict[str, None] = {}
    cols: dict[str, None] = {}
    cells: dict[tuple[str, str], CaseResult] = {}
    for r in results:
        if r.protocol == _INTEROP and _ARROW in r.feature:
            row, col = r.feature.split(_ARROW, 1)
            rows.setdefault(row)
            rows.setdefault(col)
        else:
            row, col = r.feature, r.client
            rows.setdefault(row)
            cols.setdefault(col)
        cells[(row, col)] = r
    if not cols:  # interop only
        return list(rows), list(rows), cells
    return list(rows), list(cols), cells


def _html_matrix(protocol: str, results: Sequence[CaseResult]) -> str:
    rows, cols, cells = _grid(results)
    corner = "producer \\ consumer" if protocol == _INTEROP else "feature \\ client"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for row in rows:
        tds = []
        for col in cols:
            r = cells.get((row, col))
            if r is None:
                tds.append('<td class="none"></td>')
                continue
            tip = html.escape(f"{r.client}: {r.detail}" if r.detail else r.client, quote=True)
            tds.append(
                f'<td style="background:{_COLOURS[r.outcome]}" title="{tip}">'
                f"{html.escape(r.outcome.value)}<br><small>{r.seconds:.2f}s</small></td>"
            )
        body.append(f"<tr><th>{html.escape(row)}</th>{''.join(tds)}</tr>")
    return (
        f"<h2>{html.escape(protocol)}</h2><p>{html.escape(summary(results))}</p>"
        f"<table><tr><th>{html.escape(corner)}</th>{head}</tr>{''.join(body)}</table>"
    )


def html_page(results: Sequence[CaseResult], title: str = "Conformance") -> str:
    """A self-contained page: a legend, then one coloured matrix per protocol, then the
    reasons of every row that did not pass."""
    by_protocol: dict[str, list[CaseResult]] = {}
    for r in results:
        by_protocol.setdefault(r.protocol, []).append(r)
    legend = " ".join(
        f'<span style="background:{colour};padding:2px 6px">{o.value}</span>'
        for o, colour in _COLOURS.items()
    )
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in _notes(results))
    style = (
        "body{font-family:sans-serif}table{border-collapse:collapse;margin-bottom:1em}"
        "td,th{border:1px solid #999;padding:3px 6px;text-align:center;font-size:13px}"
        "th{background:#f0f0f0}td.none{background:#fff}"
    )
    sections = "".join(_html_matrix(p, rs) for p, rs in by_protocol.items())
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>{html.escape(summary(results))}</p><p>{legend}</p>{sections}"
        f"{'<h2>Details</h2><ul>' + notes + '</ul>' if notes else ''}</body></html>\n"
    )


def comparison_markdown(
    targets: Mapping[str, Sequence[CaseResult]], title: str = "Conformance compared"
) -> str:
    """One row per (protocol, feature, client), one column per target, each cell the
    outcome there (``-`` where that target did not run the case): the same suite
    against polymq and the reference brokers, side by side."""
    keys: dict[tuple[str, str, str], None] = {}
    cells: dict[tuple[str, tuple[str, str, str]], CaseResult] = {}
    for name, results in targets.items():
        for r in results:
            key = (r.protocol, r.feature, r.client)
            keys.setdefault(key)
            cells[(name, key)] = r
    names = list(targets)
    out = [f"# {title}", ""]
    out += [f"- {name}: {summary(results)}" for name, results in targets.items()]
    out += ["", "| protocol | feature | client | " + " | ".join(names) + " |"]
    out.append("|" + "---|" * (3 + len(names)))
    for key in keys:
        marks = [cells[(n, key)].outcome.value if (n, key) in cells else "-" for n in names]
        out.append("| " + " | ".join(_md_cell(c) for c in (*key, *marks)) + " |")
    return "\n".join(out) + "\n"
