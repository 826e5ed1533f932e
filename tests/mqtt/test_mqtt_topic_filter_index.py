"""The topic-filter index: MQTT matching rules, and 100,000 subscriptions."""

from __future__ import annotations

import random

import pytest

from polymq.protocols.mqtt.topic_filter_index import (
    TopicFilterIndex,
    filter_matches,
    is_valid_filter,
    is_valid_topic_name,
    split_shared,
    topic_levels,
)

CASES = [
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/#", "sport", True),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("#", "$SYS/broker", False),
    ("+/broker", "$SYS/broker", False),
    ("$SYS/#", "$SYS/broker", True),
    ("a/+/c", "a/b/c", True),
    ("a/+/c", "a/b/d", False),
    ("a/b", "a/b/c", False),
]


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), CASES)
def test_spec_examples(topic_filter: str, topic: str, expected: bool) -> None:
    assert filter_matches(topic_filter, topic) is expected
    index: TopicFilterIndex[int] = TopicFilterIndex()
    index.add(topic_filter, "k", 1)
    assert bool(index.match(topic)) is expected


def test_validity() -> None:
    assert is_valid_filter("a/+/#") and is_valid_filter("#") and is_valid_filter("+")
    assert not is_valid_filter("a/#/b") and not is_valid_filter("a+") and not is_valid_filter("")
    assert is_valid_topic_name("a b/ü") and not is_valid_topic_name("a/+")
    assert split_shared("$share/g/a/#") == ("g", "a/#")
    assert split_shared("a/b") is None
    with pytest.raises(ValueError):
        split_shared("$share/g")


def test_remove_prunes_and_keeps_others() -> None:
    index: TopicFilterIndex[int] = TopicFilterIndex()
    index.add("a/b", 1, 1)
    index.add("a/b", 2, 2)
    index.add("a/#", 1, 3)
    assert index.remove("a/b", 1) and not index.remove("a/b", 1)
    assert sorted(v for _, v in index.match("a/b")) == [2, 3]
    index.remove("a/b", 2)
    index.remove("a/#", 1)
    assert len(index) == 0 and list(index.entries()) == []


def test_hundred_thousand_subscriptions_match_exactly() -> None:
    rng = random.Random(7)
    index: TopicFilterIndex[str] = TopicFilterIndex()
    filters = []
    for i in range(100_000):
        kind = i % 10
        building, floor, room = rng.randrange(50), rng.randrange(20), rng.randrange(100)
        if kind < 7:
            topic_filter = f"b{building}/f{floor}/r{room}/temp"
        elif kind == 7:
            topic_filter = f"b{building}/+/r{room}/temp"
        elif kind == 8:
            topic_filter = f"b{building}/f{floor}/#"
        else:
            topic_filter = f"+/f{floor}/r{room}/+"
        filters.append(topic_filter)
        index.add(topic_filter, f"client{i}", topic_filter)
    assert len(index) == 100_000
    for _ in range(20):
        topic = f"b{rng.randrange(50)}/f{rng.randrange(20)}/r{rng.randrange(100)}/temp"
        expected = sorted(f"client{i}" for i, f in enumerate(filters) if filter_matches(f, topic))
        assert sorted(str(k) for k, _ in index.match(topic)) == expected


def test_match_walks_100k_levels_without_recursion() -> None:
    """Far deeper than Python's recursion limit (issue 14: a 1,500-level wildcard
    subscription made every 1,500-level publish fail): the walk keeps its own stack,
    whatever limit the listeners put on topic levels."""
    depth = 100_000
    levels = [f"l{i % 7}" for i in range(depth)]
    topic = "/".join(levels)
    index: TopicFilterIndex[str] = TopicFilterIndex()
    index.add(topic, "exact", "exact")
    index.add("/".join([*levels[:-1], "+"]), "last-plus", "last-plus")
    index.add("/".join(["+"] * depth), "all-plus", "all-plus")
    index.add("/".join([*levels[: depth // 2], "#"]), "half-hash", "half-hash")
    index.add("/".join([*levels, "deeper"]), "too-deep", "too-deep")
    assert sorted(str(k) for k, _ in index.match(topic)) == [
        "all-plus",
        "exact",
        "half-hash",
        "last-plus",
    ]
    assert index.match("/".join(levels[:-1])) == [("half-hash", "half-hash")]
    assert index.remove(topic, "exact") and len(index) == 4
    assert sorted(str(k) for k, _ in index.match(topic)) == ["all-plus", "half-hash", "last-plus"]


def test_topic_levels() -> None:
    assert topic_levels("a") == 1 and topic_levels("a/b") == 2
    assert topic_levels("/") == 2 and topic_levels("a//b/") == 4
