"""A vhost's definitions as one gateway caches them, and as they are stored.

Publishes are routed from this cache alone, with no storage round trip per message;
the :class:`~protocols.amqp.vhost.VirtualHost` keeps it current (its own changes
and, through the change log, every other gateway's). The stored forms are the
metadata values (kinds :data:`EXCHANGE`, :data:`QUEUE`, :data:`BINDING`,
:data:`CONSUMER`) every gateway reads back when it loads the vhost, so they must not
change shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

from polymq.gateway.processor import Processor
from polymq.protocols.amqp.queues import QueueDef
from polymq.protocols.amqp.requeued import Requeued
from polymq.protocols.amqp.routing import DEFAULT_EXCHANGES, Binding, Exchange, route
from polymq.storage.model import GroupConfig

__all__ = [
    "BINDING",
    "CONSUMER",
    "EXCHANGE",
    "GROUP_CONFIG",
    "QUEUE",
    "Definitions",
    "VhostView",
    "binding_from_json",
    "binding_json",
    "binding_key",
    "exchange_from_json",
    "exchange_json",
]

EXCHANGE: Final = "amqp.exchange"
QUEUE: Final = "amqp.queue"
BINDING: Final = "amqp.binding"
CONSUMER: Final = "amqp.consumer"
# AMQP settles redeliveries and dead-lettering itself; storage's own would double them.
GROUP_CONFIG: Final = GroupConfig(max_delivery_attempts=None, dead_letter=False)
_ROUTE_CACHE_MAX: Final = 10_000


class VhostView(Protocol):
    """What delivery (dead-lettering, the expiry sweeper) reads of a vhost: typed
    apart from the vhost itself so those modules sit below it."""

    @property
    def namespace(self) -> str: ...

    @property
    def processor(self) -> Processor: ...

    @property
    def exchanges(self) -> Mapping[str, Exchange]: ...

    @property
    def queues(self) -> Mapping[str, QueueDef]: ...

    @property
    def requeued(self) -> Requeued: ...

    def route(
        self, exchange: Exchange, routing_key: str, headers: Mapping[str, Any] | None
    ) -> Iterable[str]: ...


def binding_key(binding: Binding) -> str:
    """A binding's metadata key: its id is unbounded (arguments included), a key is not."""
    return hashlib.sha1(binding.id.encode(), usedforsecurity=False).hexdigest()


def exchange_json(exchange: Exchange, home: str) -> dict[str, Any]:
    return {
        "type": exchange.type,
        "durable": exchange.durable,
        "auto_delete": exchange.auto_delete,
        "internal": exchange.internal,
        "arguments": dict(exchange.arguments),
        "home": home,
    }


def exchange_from_json(name: str, value: Mapping[str, Any]) -> Exchange:
    return Exchange(
        name=name,
        type=value["type"],
        durable=value["durable"],
        auto_delete=value["auto_delete"],
        internal=value["internal"],
        arguments=value["arguments"],
    )


def binding_json(binding: Binding) -> dict[str, Any]:
    return {
        "source": binding.source,
        "destination": binding.destination,
        "routing_key": binding.routing_key,
        "to_exchange": binding.to_exchange,
        "arguments": [list(pair) for pair in binding.arguments],
    }


def binding_from_json(value: Mapping[str, Any]) -> Binding:
    return Binding(
        source=value["source"],
        destination=value["destination"],
        routing_key=value["routing_key"],
        to_exchange=value["to_exchange"],
        arguments=tuple((k, v) for k, v in value["arguments"]),
    )


class Definitions:
    """The exchanges, queues and bindings of one vhost in this gateway, with the
    bindings indexed by source and the routes of recent publishes remembered; every
    change goes through a method that forgets the remembered routes."""

    def __init__(self) -> None:
        self.exchanges: dict[str, Exchange] = {e.name: e for e in DEFAULT_EXCHANGES}
        self.exchange_homes: dict[str, str] = {}  # transient exchanges' gateway instance
        self.queues: dict[str, QueueDef] = {}
        self.bindings: dict[str, Binding] = {}
        self._by_source: dict[str, list[Binding]] = {}
        self._route_cache: dict[tuple[str, str], frozenset[str]] = {}

    def routes_changed(self) -> None:
        """Forget the remembered routes (an exchange or queue came or went)."""
        self._route_cache.clear()

    def has_bindings_from(self, source: str) -> bool:
        return bool(self._by_source.get(source))

    def bindings_to_queue(self, name: str) -> list[Binding]:
        return [b for b in self.bindings.values() if not b.to_exchange and b.destination == name]

    def bindings_of_exchange(self, name: str) -> list[Binding]:
        """The bindings from ``name`` or to it."""
        return [
            b
            for b in self.bindings.values()
            if b.source == name or (b.to_exchange and b.destination == name)
        ]

    def add_binding(self, binding: Binding) -> None:
        self.bindings[binding.id] = binding
        self._by_source.setdefault(binding.source, []).append(binding)
        self._route_cache.clear()

    def forget_binding(self, binding_id: str) -> Binding | None:
        binding = self.bindings.pop(binding_id, None)
        if binding is None:
            return None
        remaining = [b for b in self._by_source.get(binding.source, ()) if b.id != binding_id]
        if remaining:
            self._by_source[binding.source] = remaining
        else:
            self._by_source.pop(binding.source, None)
        self._route_cache.clear()
        return binding

    def forget_exchange(self, name: str) -> None:
        """Drop an exchange and whatever bindings from or to it are still here."""
        self.exchanges.pop(name, None)
        self.exchange_homes.pop(name, None)
        self._route_cache.clear()
        for binding in self.bindings_of_exchange(name):
            self.forget_binding(binding.id)

    def apply_exchange(self, name: str, value: Mapping[str, Any] | None) -> None:
        """Another gateway's exchange change (``None``: deleted)."""
        self._route_cache.clear()
        if value is None:
            self.forget_exchange(name)
            return
        self.exchanges[name] = exchange_from_json(name, value)
        if not value["durable"]:
            self.exchange_homes[name] = str(value.get("home") or "")

    def apply_binding(self, binding_id: str, value: Mapping[str, Any] | None) -> None:
        """Another gateway's binding change (``None``: deleted)."""
        if value is None:
            self.forget_binding(binding_id)
        elif binding_id not in self.bindings:
            self.add_binding(binding_from_json(value))

    def route(
        self, exchange: Exchange, routing_key: str, headers: Mapping[str, Any] | None
    ) -> Iterable[str]:
        """Names of the existing queues a publish reaches."""
        if exchange.type == "headers":
            names: Iterable[str] = route(
                self.exchanges, self._by_source, exchange.name, routing_key, headers
            )
        else:
            key = (exchange.name, routing_key)
            cached = self._route_cache.get(key)
            if cached is None:
                cached = frozenset(
                    route(self.exchanges, self._by_source, exchange.name, routing_key, headers)
                )
                if len(self._route_cache) > _ROUTE_CACHE_MAX:
                    self._route_cache.clear()
                self._route_cache[key] = cached
            names = cached
        return [n for n in names if n in self.queues]
