"""ApiVersions, Metadata, DescribeCluster and topic administration (CreateTopics,
DeleteTopics, CreatePartitions). The brokers are the live gateways from the gateway
directory (protocols/kafka/cluster.py): each partition's leader and the controller are
chosen among them by rendezvous hashing; the merged form has one, this gateway."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from kio.schema.errors import ErrorCode

from polymq.gateway.accounts import AuthError
from polymq.navigation.endpoints import CheckedDirectory
from polymq.protocols.kafka.authz import permitted
from polymq.protocols.kafka.cluster import ClusterView
from polymq.protocols.kafka.errors import error_code
from polymq.protocols.kafka.handlers.configs import save_kept_configs, topic_config_from
from polymq.protocols.kafka.session import Session
from polymq.protocols.kafka.versions import SUPPORTED
from polymq.storage.errors import StorageError, TopicAlreadyExists, TopicNotFound
from polymq.storage.model import TopicConfig, TopicInfo

__all__ = [
    "CLUSTER_ID",
    "api_versions",
    "api_versions_body",
    "create_partitions",
    "create_topics",
    "delete_topics",
    "describe_cluster",
    "is_kafka_name",
    "metadata",
    "topic_id",
    "topic_names",
    "topic_partitions",
]

# A round of dials this recent is fresh enough; a peer slower than this to accept is
# taken as alive (navigation's expiry judges it), so a Metadata answer waits no longer.
_PEER_CHECK_AGE_S = 0.05
_PEER_CHECK_TIMEOUT_S = 0.1
_TOPIC_IDS = uuid.UUID("6f1b8a52-4d0e-4c8e-9a57-2f4c1f0b7d11")
CLUSTER_ID = "polymq"


_LEGAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def is_kafka_name(name: str) -> bool:
    """Whether Kafka would accept ``name`` as a topic name. Topics of other protocols
    (``amqp:q``, ``%DLQ%group``) are left out of "all topics" listings, which clients
    may validate, but stay reachable by name."""
    return 0 < len(name) <= 249 and name not in (".", "..") and set(name) <= _LEGAL


def api_versions_body(error: ErrorCode = ErrorCode.none) -> dict[str, Any]:
    return {
        "error_code": error,
        "api_keys": [
            {"api_key": key, "min_version": low, "max_version": high}
            for key, (low, high) in sorted(SUPPORTED.items())
        ],
        "throttle_time": 0,
    }


async def api_versions(session: Session, request: Any, version: int) -> dict[str, Any]:
    return api_versions_body()


def _brokers(cluster: ClusterView) -> list[dict[str, Any]]:
    """The live gateways, and for a few seconds those that just left, leading nothing
    (protocols/kafka/cluster.py says why)."""
    return [
        {"node_id": node.node_id, "host": node.host, "port": node.port, "rack": None}
        for node in cluster.listed
    ]


def _partitions(cluster: ClusterView, info: TopicInfo) -> list[dict[str, Any]]:
    """Every partition is served by every gateway (storage is shared); the leader
    named is the one clients should prefer, its only replica."""
    partitions = []
    for index in range(info.config.queue_count):
        leader = cluster.leader(info.name, index).node_id
        partitions.append(
            {
                "error_code": ErrorCode.none,
                "partition_index": index,
                "leader_id": leader,
                "leader_epoch": 0,
                "replica_nodes": [leader],
                "isr_nodes": [leader],
                "offline_replicas": [],
            }
        )
    return partitions


def topic_id(info: TopicInfo) -> uuid.UUID:
    """A stable id per topic incarnation (Kafka's topic ids, KIP-516): derived from
    its namespace, name and creation time, so every gateway gives the same one."""
    return uuid.uuid5(_TOPIC_IDS, f"{info.namespace}/{info.name}/{info.created_ms}")


async def topic_names(session: Session, ids: set[uuid.UUID]) -> dict[uuid.UUID, str]:
    """The names of topics asked for by id (KIP-516), from the listener's cache filled
    from the topic list when an id is new to it."""
    cache: dict[uuid.UUID, str] = session.services.topic_names
    if not ids <= cache.keys():
        for info in await session.processor.list_topics(session.caller):
            cache[topic_id(info)] = info.name
    return {i: cache[i] for i in ids if i in cache}


async def topic_partitions(
    session: Session, names: set[str]
) -> tuple[dict[str, int], dict[str, uuid.UUID]]:
    """Partition counts and topic ids of the existing topics among ``names``."""
    partitions: dict[str, int] = {}
    ids: dict[str, uuid.UUID] = {}
    for name in sorted(names):
        try:
            info = await session.processor.describe_topic(session.caller, name)
        except (StorageError, AuthError):
            continue  # a topic that is not there (or not ours) has no partitions
        partitions[name] = info.config.queue_count
        ids[name] = topic_id(info)
        session.services.topic_names[ids[name]] = name
    return partitions, ids


def _topic(cluster: ClusterView, info: TopicInfo) -> dict[str, Any]:
    return {
        "error_code": ErrorCode.none,
        "name": info.name,
        "topic_id": topic_id(info),
        "is_internal": False,
        "partitions": _partitions(cluster, info),
        "topic_authorized_operations": -2147483648,
    }


async def _describe_or_create(
    session: Session, cluster: ClusterView, name: str, create: bool
) -> dict[str, Any]:
    if not await permitted(session, "topic", name, "describe"):
        return {"error_code": ErrorCode.topic_authorization_failed, "name": name}
    try:
        return _topic(cluster, await session.processor.describe_topic(session.caller, name))
    except TopicNotFound:
        if not create:
            return {"error_code": ErrorCode.unknown_topic_or_partition, "name": name}
    except (StorageError, AuthError) as e:
        return {"error_code": error_code(e), "name": name}
    if not await permitted(session, "topic", name, "create"):
        return {"error_code": ErrorCode.topic_authorization_failed, "name": name}
    try:
        config = TopicConfig(queue_count=session.services.config.default_partitions)
        info = await session.processor.create_topic(session.caller, name, config)
    except (StorageError, AuthError) as e:
        if error_code(e) is ErrorCode.topic_already_exists:
            return await _describe_or_create(session, cluster, name, False)
        return {"error_code": error_code(e), "name": name}
    # Kafka answers LEADER_NOT_AVAILABLE while a new topic's leaders are elected;
    # ours are there at once.
    return _topic(cluster, info)


async def metadata(session: Session, request: Any, version: int) -> dict[str, Any]:
    """A client asks Metadata right after it lost a gateway: the peers are dialled
    first (one round shared by the requests of a moment), so a dead leader is moved
    in this answer, not in one the client asks for a second later."""
    directory = session.services.directory
    if isinstance(directory, CheckedDirectory):
        await directory.check_peers(max_age_s=_PEER_CHECK_AGE_S, timeout_s=_PEER_CHECK_TIMEOUT_S)
    cluster = session.cluster
    requested = request.topics
    if requested is not None and version == 0 and not requested:
        requested = None  # v0: an empty list means every topic
    if requested is None:
        infos = await session.processor.list_topics(session.caller)
        topics = [
            _topic(cluster, info)
            for info in infos
            if is_kafka_name(info.name) and await permitted(session, "topic", info.name, "describe")
        ]
    else:
        create = session.services.config.auto_create_topics and getattr(
            request, "allow_auto_topic_creation", True
        )
        topics = []
        by_id: dict[uuid.UUID, TopicInfo] | None = None
        for t in requested:
            if t.name is not None:
                topics.append(await _describe_or_create(session, cluster, t.name, create))
                continue
            if by_id is None:  # KIP-848 clients ask by topic id
                infos = await session.processor.list_topics(session.caller)
                by_id = {topic_id(info): info for info in infos}
            found = by_id.get(t.topic_id) if t.topic_id is not None else None
            if found is not None and not await permitted(session, "topic", found.name, "describe"):
                found = None
            if found is None:
                topics.append({"error_code": ErrorCode.unknown_topic_id, "topic_id": t.topic_id})
            else:
                topics.append(_topic(cluster, found))
    return {
        "throttle_time": 0,
        "brokers": _brokers(cluster),
        "cluster_id": CLUSTER_ID,
        "controller_id": cluster.controller.node_id,
        "topics": topics,
        "cluster_authorized_operations": -2147483648,
    }


async def describe_cluster(session: Session, request: Any, version: int) -> dict[str, Any]:
    cluster = session.cluster
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "cluster_id": CLUSTER_ID,
        "controller_id": cluster.controller.node_id,
        "brokers": [{**b, "broker_id": b["node_id"]} for b in _brokers(cluster)],
        "cluster_authorized_operations": -2147483648,
    }


async def create_topics(session: Session, request: Any, version: int) -> dict[str, Any]:
    results = []
    for topic in request.topics:
        partitions = topic.num_partitions
        if partitions == -1:
            partitions = session.services.config.default_partitions
        result: dict[str, Any] = {"name": topic.name, "error_code": ErrorCode.none}
        try:
            if partitions < 1:
                raise ValueError("the partition count must be positive")
            config = topic_config_from(
                {c.name: c.value for c in topic.configs}, TopicConfig(queue_count=partitions)
            )
        except ValueError as e:
            code = ErrorCode.invalid_partitions if partitions < 1 else ErrorCode.invalid_config
            results.append({**result, "error_code": code, "error_message": str(e)})
            continue
        try:
            await session.processor.authorize(session.caller, "topic", topic.name, "create")
            if request.validate_only:
                await _check_absent(session, topic.name)
            else:
                await session.processor.create_topic(session.caller, topic.name, config)
                session.services.compactor.policies.pop((session.namespace, topic.name), None)
                await save_kept_configs(
                    session, topic.name, {c.name: c.value for c in topic.configs}
                )
        except (StorageError, AuthError) as e:
            result = {**result, "error_code": error_code(e), "error_message": str(e)}
        else:
            result.update(num_partitions=partitions, replication_factor=1)
        results.append(result)
    return {"throttle_time": 0, "topics": results}


async def _check_absent(session: Session, name: str) -> None:
    try:
        await session.processor.describe_topic(session.caller, name)
    except TopicNotFound:
        return
    raise TopicAlreadyExists(f"topic {name!r} already exists")


async def delete_topics(session: Session, request: Any, version: int) -> dict[str, Any]:
    results = []
    for name in request.topic_names:
        code = ErrorCode.none
        try:
            await session.processor.authorize(session.caller, "topic", name, "delete")
            await session.processor.delete_topic(session.caller, name)
        except (StorageError, AuthError) as e:
            code = error_code(e)
        results.append({"name": name, "error_code": code})
    return {"throttle_time": 0, "responses": results}


async def create_partitions(session: Session, request: Any, version: int) -> dict[str, Any]:
    results = []
    for topic in request.topics:
        result: dict[str, Any] = {"name": topic.name, "error_code": ErrorCode.none}
        try:
            await session.processor.authorize(session.caller, "topic", topic.name, "admin")
            info = await session.processor.describe_topic(session.caller, topic.name)
            if topic.count <= info.config.queue_count:
                result.update(
                    error_code=ErrorCode.invalid_partitions,
                    error_message=f"topic has {info.config.queue_count} partitions already",
                )
            elif not request.validate_only:
                config = replace(info.config, queue_count=topic.count)
                await session.processor.alter_topic(session.caller, topic.name, config)
        except (StorageError, AuthError) as e:
            result.update(error_code=error_code(e), error_message=str(e))
        results.append(result)
    return {"throttle_time": 0, "results": results}
