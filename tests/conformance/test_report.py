"""report.py is pure: results in, text out. Checked on hand-made results, including
interop cells as helper E's matrix produces them."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

from polymq.conformance import report
from polymq.conformance.results import CaseResult, Outcome

ROWS = [
    CaseResult("amqp", "connect", "pika", Outcome.PASS, 0.01),
    CaseResult("amqp", "dead-letter", "pika", Outcome.FAIL, 1.5, "no x-death header"),
    CaseResult("mqtt", "qos2", "paho", Outcome.UNSUPPORTED, 0.2, "known missing: granted 1"),
    CaseResult("mqtt", "qos2", "gmqtt", Outcome.ERROR, 20.0, "timed out | <later>"),
    CaseResult("interop", "kafka -> mqtt", "matrix", Outcome.PASS, 0.3),
    CaseResult("interop", "mqtt -> kafka", "matrix", Outcome.FAIL, 0.4, "key lost"),
]


def test_summary_names_every_outcome() -> None:
    assert report.summary(ROWS) == "2 pass, 2 fail, 1 skip-unsupported, 1 error"
    assert report.summary([]) == "0 pass, 0 fail, 0 skip-unsupported, 0 error"


def test_text_table_aligns_columns_and_lists_reasons() -> None:
    text = report.text_table(ROWS)
    lines = text.splitlines()
    assert lines[0].split() == ["protocol", "feature", "client", "result", "time"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    # every row's result column starts at the same place
    starts = {line.index(r.outcome.value) for line, r in zip(lines[2:8], ROWS, strict=True)}
    assert len(starts) == 1
    assert "1.50s" in lines[3]
    assert "- amqp / dead-letter / pika: fail: no x-death header" in lines
    assert not any("connect / pika" in line for line in lines)  # a pass has no note
    assert report.text_table(ROWS, details=False).count("\n- ") == 0


def test_markdown_escapes_pipes_and_keeps_one_row_per_result() -> None:
    md = report.markdown(ROWS, "polymq")
    lines = md.splitlines()
    assert lines[0] == "# polymq"
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 1 + len(ROWS)  # the header and the rows
    assert "timed out \\| <later>" in md
    assert all(line.count(" | ") == 5 for line in table)  # six columns, no stray pipe


class _Cells(HTMLParser):
    """Collects (background, text) of every coloured cell, and checks tags balance."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[tuple[str, str]] = []
        self.stack: list[str] = []
        self._current: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in ("br", "meta"):
            self.stack.append(tag)
        style = dict(attrs).get("style") or ""
        if tag == "td" and "background" in style:
            self._current = style.split(":", 1)[1]
            self.cells.append((self._current, ""))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack.pop() == tag
        if tag == "td":
            self._current = None

    def handle_data(self, data: str) -> None:
        if self._current is not None and self.cells and not self.cells[-1][1]:
            self.cells[-1] = (self._current, data)


def test_html_page_is_a_coloured_matrix_per_protocol() -> None:
    page = report.html_page(ROWS, "polymq <merged>")
    parser = _Cells()
    parser.feed(page)
    assert parser.stack == []  # every tag closed
    assert "<title>polymq &lt;merged&gt;</title>" in page
    assert len(parser.cells) == len(ROWS)
    colours = {text: colour for colour, text in parser.cells}
    assert colours["pass"] != colours["fail"] != colours["skip-unsupported"] != colours["error"]
    # mqtt: one feature row, two client columns
    mqtt = page.split("<h2>mqtt</h2>")[1].split("<h2>")[0]
    assert mqtt.count("<tr>") == 2 and "<th>paho</th><th>gmqtt</th>" in mqtt
    # interop: producers down, consumers across
    interop = page.split("<h2>interop</h2>")[1].split("<h2>")[0]
    assert "producer \\ consumer" in interop
    assert "<th>kafka</th><th>mqtt</th>" in interop.split("</tr>")[0]
    assert interop.count('class="none"') == 2  # kafka->kafka and mqtt->mqtt not given
    assert "key lost" in page and "&lt;later&gt;" in page


def test_comparison_puts_targets_side_by_side() -> None:
    ours = [ROWS[0], ROWS[2]]
    theirs = [CaseResult("mqtt", "qos2", "paho", Outcome.PASS, 0.1)]
    md = report.comparison_markdown({"polymq": ours, "mosquitto": theirs}, "compared")
    lines = md.splitlines()
    assert lines[0] == "# compared"
    assert "- mosquitto: 1 pass, 0 fail, 0 skip-unsupported, 0 error" in lines
    assert "| protocol | feature | client | polymq | mosquitto |" in lines
    assert "| amqp | connect | pika | pass | - |" in lines
    assert "| mqtt | qos2 | paho | skip-unsupported | pass |" in lines


def test_compare_reads_json_results_back(tmp_path: Path) -> None:
    import dataclasses
    import json

    from polymq.conformance import compare

    path = tmp_path / "run.json"
    path.write_text(json.dumps([dataclasses.asdict(r) for r in ROWS]))
    assert compare.load_results(path) == ROWS
    out = tmp_path / "compared.md"
    assert compare.main([str(out), f"a={path}", f"b={path}"]) == 0
    assert "| amqp | dead-letter | pika | fail | fail |" in out.read_text()
    assert compare.main([str(out)]) == 2
