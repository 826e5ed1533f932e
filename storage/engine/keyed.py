"""The engine's two key-value stores: the latest message per key of a topic (MQTT's
retained messages) and the metadata of the protocols (AMQP's exchanges and bindings,
RocketMQ's groups, ...).

Both are small, read whole at restart and kept in the checkpoint, unlike queues.
"""

from __future__ import annotations

import json
from typing import Any

from polymq.storage.engine import records as rec
from polymq.storage.engine.core import EnginePart
from polymq.storage.errors import InvalidArgument, MessageTooLarge
from polymq.storage.model import Message
from polymq.storage.names import check_name

__all__ = ["LatestValues", "Metadata"]

# Metadata values are nested inside the checkpoint's JSON: a bound keeps every value
# readable back by a JSON parser with a recursion limit.
_MAX_META_DEPTH = 64


class LatestValues(EnginePart):
    """The latest message per key of each topic of one engine."""

    async def put_latest(
        self, namespace: str, topic: str, key: bytes, message: Message | None
    ) -> None:
        check_name("topic", topic)
        limit = self._core.config.max_message_bytes
        if message is not None and len(message.body) > limit:
            raise MessageTooLarge(
                f"message of {len(message.body)} bytes is over the limit of {limit} bytes"
            )
        await self._core.writable()
        self._state.namespace(namespace)
        record = rec.Latest(
            namespace, topic, bytes(key), None if message is None else rec.encode_message(message)
        )
        self._state.apply_latest(record)
        self._core.record(record)
        await self._log.wait_durable()

    def get_latest(self, namespace: str, topic: str, key: bytes) -> Message | None:
        self._core.check_open()
        value = self._state.latest.get((namespace, topic), {}).get(bytes(key))
        return None if value is None else rec.decode_message(value)

    def list_latest(self, namespace: str, topic: str) -> list[tuple[bytes, Message]]:
        self._core.check_open()
        values = self._state.latest.get((namespace, topic), {})
        return [(key, rec.decode_message(value)) for key, value in sorted(values.items())]


class Metadata(EnginePart):
    """The protocols' metadata of one engine, JSON values by namespace, kind and name."""

    async def meta_put(self, namespace: str, kind: str, name: str, value: Any) -> None:
        check_name("metadata kind", kind)
        check_name("metadata name", name)
        if _nesting_depth(value) > _MAX_META_DEPTH:
            raise InvalidArgument(f"metadata value is nested deeper than {_MAX_META_DEPTH} levels")
        try:
            value = json.loads(json.dumps(value))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"metadata value is not JSON-compatible: {exc}") from exc
        await self._core.writable()
        self._state.namespace(namespace)
        end = self._core.meta(op="kv_put", ns=namespace, kind=kind, name=name, value=value)
        await self._log.wait_durable(end)

    def meta_get(self, namespace: str, kind: str, name: str) -> Any | None:
        self._core.check_open()
        return self._state.kv.get((namespace, kind), {}).get(name)

    async def meta_delete(self, namespace: str, kind: str, name: str) -> bool:
        await self._core.writable()
        if name not in self._state.kv.get((namespace, kind), {}):
            return False
        end = self._core.meta(op="kv_delete", ns=namespace, kind=kind, name=name)
        await self._log.wait_durable(end)
        return True

    def meta_list(self, namespace: str, kind: str) -> dict[str, Any]:
        self._core.check_open()
        return dict(self._state.kv.get((namespace, kind), {}))


def _nesting_depth(value: Any, depth: int = 0) -> int:
    """How deep lists and dicts nest in ``value`` (stops counting past the bound)."""
    if depth > _MAX_META_DEPTH or not isinstance(value, list | dict):
        return depth
    children = value.values() if isinstance(value, dict) else value
    return max((_nesting_depth(child, depth + 1) for child in children), default=depth + 1)
