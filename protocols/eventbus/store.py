"""Buses and rules kept as storage metadata through the processor (kinds
``eventbus.bus`` and ``eventbus.rule``, the latter named ``bus/rule``), so every
gateway sees them and they survive restarts; and each bus's storage topic (its events
and archive), created with the bus.

The default bus of a namespace exists without being created: it is made on first use.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Final

from polymq.gateway.processor import Caller, Processor
from polymq.protocols.eventbus.model import (
    DEFAULT_BUS,
    Bus,
    DefinitionError,
    Rule,
    Target,
    bus_topic,
)
from polymq.protocols.mns.queues import QUEUE_KIND
from polymq.storage.errors import TopicAlreadyExists, TopicNotFound
from polymq.storage.model import TopicConfig

__all__ = ["BUS_KIND", "RULE_KIND", "BusStore", "NotFound"]

BUS_KIND: Final = "eventbus.bus"
RULE_KIND: Final = "eventbus.rule"


class NotFound(LookupError):
    """No such bus or rule."""


def _rule_key(bus: str, rule: str) -> str:
    return f"{bus}/{rule}"


class BusStore:
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    async def put_bus(self, caller: Caller, bus: Bus) -> bool:
        """Create or change a bus; ``True`` when it is new. The caller must be allowed
        to read its source topics (docs/permissions.md): the dispatchers read them
        with an identity of their own."""
        for source in bus.sources:
            await self.processor.authorize(caller, "topic", source, "read")
        existing = await self.processor.meta_get(caller, BUS_KIND, bus.name)
        await self._ensure_topic(caller, bus)
        await self.processor.meta_put(caller, BUS_KIND, bus.name, bus.to_json())
        return existing is None

    async def _ensure_topic(self, caller: Caller, bus: Bus) -> None:
        config = TopicConfig(queue_count=1, retention_ms=bus.retention_ms, internal=True)
        try:
            await self.processor.create_topic(caller, bus_topic(bus.name), config)
        except TopicAlreadyExists:
            info = await self.processor.describe_topic(caller, bus_topic(bus.name))
            if info.config.retention_ms != bus.retention_ms:
                await self.processor.alter_topic(
                    caller, bus_topic(bus.name), replace(info.config, retention_ms=bus.retention_ms)
                )

    async def bus(self, caller: Caller, name: str) -> Bus:
        raw = await self.processor.meta_get(caller, BUS_KIND, name)
        if raw is not None:
            return Bus.parse(name, raw)
        if name == DEFAULT_BUS:
            bus = Bus(name=DEFAULT_BUS)
            await self.put_bus(caller, bus)
            return bus
        raise NotFound(f"bus {name!r} does not exist")

    async def buses(self, caller: Caller) -> list[Bus]:
        found = await self.processor.meta_list(caller, BUS_KIND)
        if DEFAULT_BUS not in found:
            await self.bus(caller, DEFAULT_BUS)
            found = await self.processor.meta_list(caller, BUS_KIND)
        return [Bus.parse(name, raw) for name, raw in sorted(found.items())]

    async def delete_bus(self, caller: Caller, name: str) -> None:
        if name == DEFAULT_BUS:
            raise DefinitionError("the default bus cannot be deleted")
        await self.bus(caller, name)
        for rule in await self.rules(caller, name):
            await self.processor.meta_delete(caller, RULE_KIND, _rule_key(name, rule.name))
        await self.processor.meta_delete(caller, BUS_KIND, name)
        with contextlib.suppress(TopicNotFound):
            await self.processor.delete_topic(caller, bus_topic(name))

    async def put_rule(self, caller: Caller, rule: Rule) -> bool:
        """Create or replace a rule (its bus must exist); ``True`` when it is new.
        Topic targets are created when missing (one queue); queue targets must be
        MNS queues already. The caller must be allowed to write every target (and to
        create a missing topic): the dispatchers write with an identity of their own,
        so a rule must not reach further than its author."""
        await self.bus(caller, rule.bus)
        for target in (*rule.targets, *((rule.dead_letter,) if rule.dead_letter else ())):
            await self._check_target(caller, target)
        key = _rule_key(rule.bus, rule.name)
        existing = await self.processor.meta_get(caller, RULE_KIND, key)
        await self.processor.meta_put(caller, RULE_KIND, key, rule.to_json())
        return existing is None

    async def _check_target(self, caller: Caller, target: Target) -> None:
        if target.type == "http":
            return
        assert target.name is not None
        await self.processor.authorize(caller, "topic", target.name, "write")
        if target.type == "queue":
            if await self.processor.meta_get(caller, QUEUE_KIND, target.name) is None:
                raise DefinitionError(
                    f"target {target.id}: MNS queue {target.name!r} does not exist"
                )
        elif target.type == "topic":
            try:
                await self.processor.describe_topic(caller, target.name)
            except TopicNotFound:
                await self.processor.authorize(caller, "topic", target.name, "create")
                with contextlib.suppress(TopicAlreadyExists):
                    await self.processor.create_topic(
                        caller, target.name, TopicConfig(queue_count=1)
                    )

    async def rule(self, caller: Caller, bus: str, name: str) -> Rule:
        raw = await self.processor.meta_get(caller, RULE_KIND, _rule_key(bus, name))
        if raw is None:
            raise NotFound(f"rule {name!r} of bus {bus!r} does not exist")
        return Rule.parse(bus, name, raw)

    async def rules(self, caller: Caller, bus: str) -> list[Rule]:
        prefix = f"{bus}/"
        return [
            Rule.parse(bus, key[len(prefix) :], raw)
            for key, raw in sorted((await self.processor.meta_list(caller, RULE_KIND)).items())
            if key.startswith(prefix)
        ]

    async def delete_rule(self, caller: Caller, bus: str, name: str) -> None:
        if not await self.processor.meta_delete(caller, RULE_KIND, _rule_key(bus, name)):
            raise NotFound(f"rule {name!r} of bus {bus!r} does not exist")
