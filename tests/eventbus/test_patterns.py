"""The pattern language against a corpus written from the published documentation
(tests/eventbus/pattern_corpus.json), and the rule index against a plain pass over
every rule: the index must find exactly what a full pass finds."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from polymq.protocols.eventbus.patterns import PatternError, compile_pattern
from polymq.protocols.eventbus.rule_index import RuleIndex

ONE_FORM = True  # pure: starts no server

_CORPUS = json.loads((Path(__file__).parent / "pattern_corpus.json").read_text())
_MATCHES = [
    pytest.param(case["pattern"], event, expected, id=f"{case['name']}-{i}")
    for case in _CORPUS["cases"]
    for i, (event, expected) in enumerate(case["events"])
]


@pytest.mark.parametrize(("pattern", "event", "expected"), _MATCHES)
def test_corpus(pattern: dict[str, Any], event: dict[str, Any], expected: bool) -> None:
    assert compile_pattern(pattern).matches(event) is expected
    # The index finds the same answer as the pattern alone.
    assert RuleIndex([(compile_pattern(pattern), "rule")]).match(event) == (
        ["rule"] if expected else []
    )


@pytest.mark.parametrize(
    ("pattern", "error"), [(c["pattern"], c["error"]) for c in _CORPUS["invalid"]]
)
def test_invalid_patterns_are_refused_with_the_reason(pattern: Any, error: str) -> None:
    with pytest.raises(PatternError) as raised:
        compile_pattern(pattern)
    assert error in str(raised.value)


def test_the_index_finds_what_a_full_pass_finds() -> None:
    rng = random.Random(7)
    patterns: list[dict[str, Any]] = []
    for i in range(300):
        kind = i % 4
        if kind == 0:
            patterns.append({"type": [f"t{rng.randrange(20)}"]})
        elif kind == 1:
            patterns.append({"source": ["s"], "data": {"n": [rng.randrange(10), "x"]}})
        elif kind == 2:
            patterns.append({"data": {"n": [{"numeric": [">", rng.randrange(10)]}]}})
        else:
            patterns.append({"$or": [{"type": [f"t{rng.randrange(20)}"]}, {"subject": ["q"]}]})
    compiled = [(compile_pattern(p), i) for i, p in enumerate(patterns)]
    index = RuleIndex(compiled)
    assert index.scanned == 75  # only the numeric rules are scanned
    for _ in range(200):
        event = {
            "type": f"t{rng.randrange(25)}",
            "source": rng.choice(["s", "z"]),
            "subject": rng.choice(["q", "r"]),
            "data": {"n": rng.choice([rng.randrange(12), [1, 2], "x"])},
        }
        assert index.match(event) == [i for p, i in compiled if p.matches(event)]
