"""Exchange routing (spec section 3.1.3 and RabbitMQ's extensions): pure functions
over exchanges and bindings, no I/O.

Exchange-to-exchange bindings are followed transitively, each exchange visited once,
so binding cycles terminate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Final

__all__ = [
    "DEFAULT_EXCHANGES",
    "EXCHANGE_TYPES",
    "Binding",
    "Exchange",
    "headers_match",
    "route",
    "topic_matches",
]

EXCHANGE_TYPES: Final = frozenset({"direct", "fanout", "topic", "headers"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Exchange:
    name: str
    type: str
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Binding:
    """``source`` exchange to a queue or (``to_exchange``) another exchange."""

    source: str
    destination: str
    routing_key: str
    to_exchange: bool = False
    arguments: tuple[tuple[str, Any], ...] = ()

    @property
    def id(self) -> str:
        kind = "e" if self.to_exchange else "q"
        args = ",".join(f"{k}={v!r}" for k, v in self.arguments)
        return f"{kind}\x1f{self.source}\x1f{self.destination}\x1f{self.routing_key}\x1f{args}"


# The exchanges every vhost has (RabbitMQ predeclares them; "" is the default exchange).
DEFAULT_EXCHANGES: Final = (
    Exchange(name="", type="direct"),
    Exchange(name="amq.direct", type="direct"),
    Exchange(name="amq.fanout", type="fanout"),
    Exchange(name="amq.topic", type="topic"),
    Exchange(name="amq.headers", type="headers"),
    Exchange(name="amq.match", type="headers"),
)


@lru_cache(maxsize=65536)
def topic_matches(binding_key: str, routing_key: str) -> bool:
    """AMQP topic matching: words split on ".", "*" is exactly one word, "#" zero or
    more words."""
    return _match_words(tuple(binding_key.split(".")), tuple(routing_key.split(".")))


def _match_words(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    # reachable[j]: the pattern's first i words can match the routing key's first j.
    reachable = [True] + [False] * len(words)
    for word in pattern:
        if word == "#":
            for j in range(1, len(words) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            for j in range(len(words), 0, -1):
                reachable[j] = reachable[j - 1] and (word == "*" or word == words[j - 1])
            reachable[0] = False
    return reachable[len(words)]


def headers_match(arguments: Sequence[tuple[str, Any]], headers: Mapping[str, Any]) -> bool:
    """RabbitMQ's headers exchange: ``x-match`` ``all`` (default) or ``any``
    (``all-with-x`` / ``any-with-x`` also compare ``x-`` keys); a binding value of
    void matches the key's mere presence."""
    mode = "all"
    wanted: list[tuple[str, Any]] = []
    for key, value in arguments:
        if key == "x-match":
            mode = str(value)
        else:
            wanted.append((key, value))
    with_x = mode.endswith("-with-x")
    if not with_x:
        wanted = [(k, v) for k, v in wanted if not k.startswith("x-")]
    if mode.startswith("any"):
        return any(_header_equal(k, v, headers) for k, v in wanted)
    return all(_header_equal(k, v, headers) for k, v in wanted)


def _header_equal(key: str, value: Any, headers: Mapping[str, Any]) -> bool:
    if key not in headers:
        return False
    if value is None:
        return True
    actual = headers[key]
    if isinstance(actual, bytes | bytearray) and isinstance(value, str):
        return bytes(actual) == value.encode()
    return bool(actual == value)


def route(
    exchanges: Mapping[str, Exchange],
    bindings: Mapping[str, Sequence[Binding]],
    exchange: str,
    routing_key: str,
    headers: Mapping[str, Any] | None,
) -> set[str]:
    """The queues a message published to ``exchange`` reaches."""
    queues: set[str] = set()
    visited: set[str] = set()
    pending = [exchange]
    while pending:
        name = pending.pop()
        if name in visited:
            continue
        visited.add(name)
        source = exchanges.get(name)
        if source is None:
            continue
        if name == "":
            queues.add(routing_key)  # the default exchange: every queue by its name
            continue
        for binding in bindings.get(name, ()):
            if _binding_matches(source.type, binding, routing_key, headers):
                if binding.to_exchange:
                    pending.append(binding.destination)
                else:
                    queues.add(binding.destination)
        alternate = source.arguments.get("alternate-exchange")
        if alternate and not queues and isinstance(alternate, str):
            pending.append(alternate)
    return queues


def _binding_matches(
    kind: str, binding: Binding, routing_key: str, headers: Mapping[str, Any] | None
) -> bool:
    if kind == "fanout":
        return True
    if kind == "direct":
        return binding.routing_key == routing_key
    if kind == "topic":
        return topic_matches(binding.routing_key, routing_key)
    if kind == "headers":
        return headers_match(binding.arguments, headers or {})
    return False
