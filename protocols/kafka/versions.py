"""The API versions this broker serves, and nothing more: librdkafka picks the highest
version both sides name, so a version listed here must be fully handled.

Upper bounds stop before changes we do not implement: Produce v10+ / Fetch v13+ (topic
ids in requests), Metadata v13, OffsetCommit v10+.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["API_VERSIONS_KEY", "SUPPORTED"]

API_VERSIONS_KEY = 18

SUPPORTED: Mapping[int, tuple[int, int]] = MappingProxyType(
    {
        0: (3, 9),  # Produce
        1: (4, 12),  # Fetch
        2: (1, 7),  # ListOffsets
        3: (0, 12),  # Metadata
        8: (2, 9),  # OffsetCommit
        9: (1, 9),  # OffsetFetch
        10: (0, 4),  # FindCoordinator (v4: batched keys)
        11: (0, 7),  # JoinGroup
        12: (0, 4),  # Heartbeat
        13: (0, 4),  # LeaveGroup
        14: (0, 5),  # SyncGroup
        15: (0, 5),  # DescribeGroups
        16: (0, 5),  # ListGroups
        17: (0, 1),  # SaslHandshake
        18: (0, 3),  # ApiVersions
        19: (2, 7),  # CreateTopics
        20: (1, 5),  # DeleteTopics
        21: (0, 2),  # DeleteRecords
        22: (0, 4),  # InitProducerId
        23: (2, 4),  # OffsetForLeaderEpoch
        24: (0, 3),  # AddPartitionsToTxn
        25: (0, 3),  # AddOffsetsToTxn
        26: (0, 3),  # EndTxn
        28: (0, 3),  # TxnOffsetCommit
        29: (1, 3),  # DescribeAcls (v1: pattern types)
        30: (1, 3),  # CreateAcls
        31: (1, 3),  # DeleteAcls
        32: (1, 4),  # DescribeConfigs
        33: (0, 2),  # AlterConfigs
        36: (0, 2),  # SaslAuthenticate
        37: (0, 3),  # CreatePartitions
        42: (0, 2),  # DeleteGroups
        44: (0, 1),  # IncrementalAlterConfigs
        47: (0, 0),  # OffsetDelete
        60: (0, 1),  # DescribeCluster
        68: (0, 1),  # ConsumerGroupHeartbeat
        69: (0, 1),  # ConsumerGroupDescribe
        76: (1, 1),  # ShareGroupHeartbeat
        77: (1, 1),  # ShareGroupDescribe
        78: (1, 1),  # ShareFetch
        79: (1, 1),  # ShareAcknowledge
    }
)
