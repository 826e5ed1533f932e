"""One handler per Kafka API, keyed by API key. A handler takes the session, the
decoded request (a kio entity of the version asked) and that version, and returns a
plain dict shaped into the response by :func:`protocols.kafka.codec.build`, or
``None`` when Kafka sends no response (Produce with acks=0)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

from polymq.protocols.kafka.handlers import (
    acls,
    configs,
    consumer_group,
    fetch,
    groups,
    produce,
    sasl,
    share,
    topics,
    transactions,
)
from polymq.protocols.kafka.session import Session

__all__ = ["HANDLERS", "Handler"]

Handler = Callable[[Session, Any, int], Awaitable[dict[str, Any] | None]]

HANDLERS: Mapping[int, Handler] = MappingProxyType(
    {
        0: produce.produce,
        1: fetch.fetch,
        2: fetch.list_offsets,
        3: topics.metadata,
        8: groups.offset_commit,
        9: groups.offset_fetch,
        10: groups.find_coordinator,
        11: groups.join_group,
        12: groups.heartbeat,
        13: groups.leave_group,
        14: groups.sync_group,
        15: groups.describe_groups,
        16: groups.list_groups,
        17: sasl.sasl_handshake,
        18: topics.api_versions,
        19: topics.create_topics,
        20: topics.delete_topics,
        21: fetch.delete_records,
        22: produce.init_producer_id,
        23: fetch.offset_for_leader_epoch,
        24: transactions.add_partitions_to_txn,
        25: transactions.add_offsets_to_txn,
        26: transactions.end_txn,
        28: transactions.txn_offset_commit,
        29: acls.describe_acls,
        30: acls.create_acls,
        31: acls.delete_acls,
        32: configs.describe_configs,
        33: configs.alter_configs,
        36: sasl.sasl_authenticate,
        37: topics.create_partitions,
        42: groups.delete_groups,
        44: configs.incremental_alter_configs,
        47: groups.offset_delete,
        60: topics.describe_cluster,
        68: consumer_group.consumer_group_heartbeat,
        69: consumer_group.consumer_group_describe,
        76: share.share_group_heartbeat,
        77: share.share_group_describe,
        78: share.share_fetch,
        79: share.share_acknowledge,
    }
)
