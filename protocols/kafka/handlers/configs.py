"""DescribeConfigs, AlterConfigs and IncrementalAlterConfigs for the topic configs we
honour: retention.ms, retention.bytes and max.message.bytes map onto the storage
topic's config; cleanup.policy and delete.retention.ms are kept beside it and drive
the compactor (protocols/kafka/compaction.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.protocols.kafka.compaction import DEFAULT_DELETE_RETENTION_MS, is_compacted
from polymq.protocols.kafka.errors import error_code
from polymq.protocols.kafka.session import Session
from polymq.storage.errors import StorageError
from polymq.storage.model import UNLIMITED, TopicConfig

__all__ = [
    "alter_configs",
    "compaction_of",
    "describe_configs",
    "incremental_alter_configs",
    "save_kept_configs",
    "topic_config_from",
]

TOPIC = 2
BROKER = 4
_SOURCE_TOPIC = 1
_SOURCE_DEFAULT = 5
_META_KIND = "kafka.topic-config"

# Kafka's defaults for what storage leaves unset.
_DEFAULTS = {
    "retention.ms": "604800000",
    "retention.bytes": "-1",
    "max.message.bytes": "1048588",
    "cleanup.policy": "delete",
    "delete.retention.ms": str(DEFAULT_DELETE_RETENTION_MS),
}
_FIELDS = {
    "retention.ms": "retention_ms",
    "retention.bytes": "retention_bytes",
    "max.message.bytes": "max_message_bytes",
}
_POLICIES = {"delete", "compact", "compact,delete", "delete,compact"}
_KEPT = ("cleanup.policy", "delete.retention.ms")


def topic_config_from(values: dict[str, str | None], base: TopicConfig) -> TopicConfig:
    """``base`` with Kafka config ``values`` applied (``None`` resets to default).
    Raises ValueError for a config we do not know or a bad value.

    ``cleanup.policy=compact`` alone keeps records until compaction removes them, as in
    Kafka (where retention.ms applies to the delete policy only): the storage topic
    then keeps everything (``retention_ms`` unlimited), so a key's latest value never
    ages out, unless the same request sets ``retention.ms`` (applied then: our
    retention is storage's, which Kafka would not apply to a compact-only topic)."""
    changes: dict[str, int | None] = {}
    if values.get("cleanup.policy") == "compact":
        changes.update(retention_ms=UNLIMITED, retention_bytes=None)
    for name, value in values.items():
        if name == "cleanup.policy":
            if value is not None and value not in _POLICIES:
                raise ValueError(f"bad cleanup.policy {value!r}")
            continue
        if name == "delete.retention.ms":
            if value is not None and (not value.lstrip("-").isdigit() or int(value) < 0):
                raise ValueError(f"bad delete.retention.ms {value!r}")
            continue
        field = _FIELDS.get(name)
        if field is None:
            continue  # configs we do not honour are accepted and ignored, as tansu does
        if value is None:
            changes[field] = None
            continue
        number = int(value)
        if number == -1 and field == "retention_ms":
            changes[field] = UNLIMITED
        elif number == -1 and field == "retention_bytes":
            changes[field] = None
        elif number <= 0:
            raise ValueError(f"{name} must be positive")
        else:
            changes[field] = number
    return replace(base, **changes)  # type: ignore[arg-type]


def _value(config: TopicConfig, name: str, extra: dict[str, Any]) -> tuple[str, int]:
    if name in _KEPT:
        policy = extra.get(name)
        return (policy, _SOURCE_TOPIC) if policy else (_DEFAULTS[name], _SOURCE_DEFAULT)
    value = getattr(config, _FIELDS[name])
    if value is None:
        return _DEFAULTS[name], _SOURCE_DEFAULT
    return str(value), _SOURCE_TOPIC


async def _extra(session: Session, topic: str) -> dict[str, Any]:
    stored = await session.processor.meta_get(session.caller, _META_KIND, topic)
    return stored if isinstance(stored, dict) else {}


async def save_kept_configs(session: Session, topic: str, values: dict[str, str | None]) -> None:
    """Store the configs the storage topic has no field for (``cleanup.policy``,
    ``delete.retention.ms``) beside it, and forget the compactor's cached view."""
    kept = {name: values[name] for name in _KEPT if name in values}
    if not kept:
        return
    extra = await _extra(session, topic)
    extra.update(kept)
    await session.processor.meta_put(session.caller, _META_KIND, topic, extra)
    session.services.compactor.policies.pop((session.namespace, topic), None)


async def compaction_of(session: Session, topic: str) -> int | None:
    """``delete.retention.ms`` of a compacted topic, None if it is not compacted
    (cached per topic: produce asks this for every batch)."""
    key = (session.namespace, topic)
    policies = session.services.compactor.policies
    if key not in policies:
        extra = await _extra(session, topic)
        retention = extra.get("delete.retention.ms")
        policies[key] = (
            (int(retention) if retention is not None else DEFAULT_DELETE_RETENTION_MS)
            if is_compacted(extra.get("cleanup.policy"))
            else None
        )
    return policies[key]


async def describe_configs(session: Session, request: Any, version: int) -> dict[str, Any]:
    results = []
    for resource in request.resources:
        result: dict[str, Any] = {
            "error_code": ErrorCode.none,
            "resource_type": resource.resource_type,
            "resource_name": resource.resource_name,
            "configs": [],
        }
        wanted = resource.configuration_keys
        if resource.resource_type == BROKER:
            names = [n for n in _DEFAULTS if wanted is None or n in wanted]
            result["configs"] = [
                _entry(n, _DEFAULTS[n], _SOURCE_DEFAULT, read_only=True) for n in names
            ]
        elif resource.resource_type == TOPIC:
            try:
                await session.processor.authorize(
                    session.caller, "topic", resource.resource_name, "describe"
                )
                info = await session.processor.describe_topic(
                    session.caller, resource.resource_name
                )
                extra = await _extra(session, resource.resource_name)
            except (StorageError, AuthError) as e:
                result.update(error_code=error_code(e), error_message=str(e))
            else:
                result["configs"] = [
                    _entry(n, *_value(info.config, n, extra), read_only=False)
                    for n in _DEFAULTS
                    if wanted is None or n in wanted
                ]
        else:
            result.update(error_code=ErrorCode.invalid_request, error_message="resource type")
        results.append(result)
    return {"throttle_time": 0, "results": results}


def _entry(name: str, value: str, source: int, *, read_only: bool) -> dict[str, Any]:
    return {
        "name": name,
        "value": value,
        "read_only": read_only,
        "config_source": source,
        "is_default": source == _SOURCE_DEFAULT,
        "is_sensitive": False,
        "synonyms": [],
        "documentation": None,
    }


async def _alter(
    session: Session, resource: Any, values: dict[str, str | None], validate_only: bool
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "error_code": ErrorCode.none,
        "resource_type": resource.resource_type,
        "resource_name": resource.resource_name,
    }
    if resource.resource_type != TOPIC:
        return {**result, "error_code": ErrorCode.invalid_request, "error_message": "topics only"}
    try:
        await session.processor.authorize(session.caller, "topic", resource.resource_name, "admin")
        info = await session.processor.describe_topic(session.caller, resource.resource_name)
        config = topic_config_from(values, info.config)
        if not validate_only:
            await session.processor.alter_topic(session.caller, resource.resource_name, config)
            await save_kept_configs(session, resource.resource_name, values)
    except ValueError as e:
        result.update(error_code=ErrorCode.invalid_config, error_message=str(e))
    except (StorageError, AuthError) as e:
        result.update(error_code=error_code(e), error_message=str(e))
    return result


async def alter_configs(session: Session, request: Any, version: int) -> dict[str, Any]:
    """Non-incremental: configs left out return to their defaults."""
    responses = []
    for resource in request.resources:
        values: dict[str, str | None] = dict.fromkeys(_DEFAULTS)
        values.update({c.name: c.value for c in resource.configs})
        responses.append(await _alter(session, resource, values, request.validate_only))
    return {"throttle_time": 0, "responses": responses}


_SET, _DELETE = 0, 1


async def incremental_alter_configs(session: Session, request: Any, version: int) -> dict[str, Any]:
    responses = []
    for resource in request.resources:
        values: dict[str, str | None] = {}
        for c in resource.configs:
            values[c.name] = c.value if c.config_operation == _SET else None
        responses.append(await _alter(session, resource, values, request.validate_only))
    return {"throttle_time": 0, "responses": responses}
