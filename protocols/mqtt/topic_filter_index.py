"""Topic names, topic filters, and the index that finds the subscriptions a topic
name matches.

The index is a trie over topic levels (v5 4.7): a lookup walks one path per literal
level plus the ``+`` and ``#`` branches, so its cost grows with the depth of the topic
and the number of wildcard branches met, not with the number of subscriptions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "SHARE_PREFIX",
    "TopicFilterIndex",
    "filter_matches",
    "is_valid_filter",
    "is_valid_topic_name",
    "split_shared",
    "topic_levels",
]

_V = TypeVar("_V")

SHARE_PREFIX = "$share/"


def topic_levels(topic: str) -> int:
    """Levels of a topic name or filter (``a//b`` has three, ``/`` two)."""
    return topic.count("/") + 1


def is_valid_topic_name(topic: str) -> bool:
    """A PUBLISH topic: at least one character and no wildcard (v5 4.7.3, 3.3.2.1)."""
    return bool(topic) and "+" not in topic and "#" not in topic


def is_valid_filter(topic_filter: str) -> bool:
    """``#`` only as the whole last level, ``+`` only as a whole level (v5 4.7.1)."""
    if not topic_filter:
        return False
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def split_shared(topic_filter: str) -> tuple[str, str] | None:
    """``$share/{group}/{filter}`` to ``(group, filter)`` (v5 4.8.2); ``None`` for a
    plain filter. Raises ``ValueError`` for a malformed shared filter."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None
    group, sep, rest = topic_filter[len(SHARE_PREFIX) :].partition("/")
    if not sep or not group or "+" in group or "#" in group or not is_valid_filter(rest):
        raise ValueError(f"malformed shared subscription {topic_filter!r}")
    return group, rest


def filter_matches(topic_filter: str, topic: str) -> bool:
    """Whether one filter matches one topic name (the index does the same at scale)."""
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    if topic.startswith("$") and f_levels[0] in ("+", "#"):
        return False
    for i, level in enumerate(f_levels):
        if level == "#":
            return True
        if i >= len(t_levels):
            return False
        if level != "+" and level != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


@dataclass(slots=True)
class _Node(Generic[_V]):
    children: dict[str, _Node[_V]] = field(default_factory=dict)
    entries: dict[object, _V] = field(default_factory=dict)


class TopicFilterIndex(Generic[_V]):
    """Filters to entries: each (filter, key) holds one value; :meth:`match` returns
    every (key, value) whose filter matches a topic name.

    Topics starting with ``$`` are not matched by a ``+`` or ``#`` first level
    (v5 4.7.2), so ``#`` subscribers never see ``$SYS``."""

    def __init__(self) -> None:
        self._root: _Node[_V] = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, topic_filter: str, key: object, value: _V) -> bool:
        """Set the entry; True if it is new (not a replacement)."""
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        new = key not in node.entries
        node.entries[key] = value
        self._count += new
        return new

    def remove(self, topic_filter: str, key: object) -> bool:
        """Drop the entry, pruning emptied branches; False if it was not there."""
        path: list[tuple[_Node[_V], str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        if key not in node.entries:
            return False
        del node.entries[key]
        self._count -= 1
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.entries or child.children:
                break
            del parent.children[level]
        return True

    def match(self, topic: str) -> list[tuple[object, _V]]:
        """Every (key, value) whose filter matches ``topic``.

        The walk keeps its own stack rather than recursing: a topic may have far more
        levels than Python's recursion limit (a 1,500-level subscription once made every
        1,500-level publish fail), and the listeners' level limit must not be what keeps
        the index correct."""
        levels = topic.split("/")
        end = len(levels)
        system = topic.startswith("$")
        found: list[tuple[object, _V]] = []
        stack: list[tuple[_Node[_V], int]] = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            children = node.children
            wild = not (system and depth == 0)
            if wild:
                multi = children.get("#")
                if multi is not None:  # "a/#" also matches "a" (v5 4.7.1.2)
                    found.extend(multi.entries.items())
            if depth == end:
                found.extend(node.entries.items())
                continue
            if wild:
                single = children.get("+")
                if single is not None:
                    stack.append((single, depth + 1))
            exact = children.get(levels[depth])
            if exact is not None:
                stack.append((exact, depth + 1))  # popped first: the exact path leads
        return found

    def entries(self) -> Iterator[tuple[str, object, _V]]:
        """Every (filter, key, value), for inspection and tests."""
        stack: list[tuple[str | None, _Node[_V]]] = [(None, self._root)]
        while stack:
            prefix, node = stack.pop()
            if prefix is not None:
                for key, value in node.entries.items():
                    yield prefix, key, value
            for level, child in node.children.items():
                stack.append((level if prefix is None else f"{prefix}/{level}", child))
