"""Which rules an event matches, without a pass over every rule.

Each rule is indexed by the literal values of its most selective field
(:attr:`Pattern.index_field`): ``path -> value -> rules``. An event looks up its own
values at each indexed path (a handful of distinct paths however many rules), and
only the rules found there, plus those with no field of literal values (kept in a
scan list), are matched in full. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

from polymq.protocols.eventbus.patterns import MISSING, Pattern, ValueKey, value_key, values_at

__all__ = ["RuleIndex"]

R = TypeVar("R")


class RuleIndex(Generic[R]):
    """An immutable index over ``(pattern, rule)`` pairs; :meth:`match` returns the
    rules whose pattern matches, in the order they were given."""

    def __init__(self, entries: Iterable[tuple[Pattern, R]]) -> None:
        self._entries: list[tuple[Pattern, R]] = list(entries)
        # path -> literal value key -> rules
        self._exact: dict[tuple[str, ...], dict[ValueKey, list[int]]] = {}
        # (path, "^" or "$") -> prefix or suffix -> rules, and the lengths to try
        self._affix: dict[tuple[tuple[str, ...], str], dict[str, list[int]]] = {}
        self._lengths: dict[tuple[tuple[str, ...], str], list[int]] = {}
        self._scan: list[int] = []
        for i, (pattern, _) in enumerate(self._entries):
            if pattern.index_keys is None:
                self._scan.append(i)
                continue
            for path, kind, key in pattern.index_keys:
                if kind == "=":
                    self._exact.setdefault(path, {}).setdefault(key, []).append(i)
                else:
                    self._affix.setdefault((path, kind), {}).setdefault(key, []).append(i)
        for where, table in self._affix.items():
            self._lengths[where] = sorted({len(text) for text in table})

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def scanned(self) -> int:
        """How many rules every event is matched against in full (no index key)."""
        return len(self._scan)

    def candidates(self, event: Mapping[str, Any]) -> set[int]:
        """The rules the event may match: those its values find, and the scanned."""
        found: set[int] = set(self._scan)
        for path, table in self._exact.items():
            for value in values_at(event, path):
                if value is MISSING:
                    break
                key = value_key(value)
                if key is not None and key in table:
                    found.update(table[key])
        for (path, kind), by_text in self._affix.items():
            lengths = self._lengths[(path, kind)]
            for value in values_at(event, path):
                if not isinstance(value, str):
                    continue
                for length in lengths:
                    if length > len(value):
                        break
                    hit = by_text.get(value[:length] if kind == "^" else value[-length:])
                    if hit:
                        found.update(hit)
        return found

    def match(self, event: Mapping[str, Any]) -> list[R]:
        return [
            self._entries[i][1]
            for i in sorted(self.candidates(event))
            if self._entries[i][0].matches(event)
        ]
