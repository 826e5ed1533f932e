"""What one storage process measures of the replicated pool, for its ``/metrics``
(docs/metrics.md): how long JetStream takes to acknowledge a publish, which shards
it acquired and how long each took to serve, which lease renewals failed and which
leases it lost, and what it owns now.

Plain counts kept on the event loop (every observation is made there), rendered by
``storage/node_metrics.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from polymq.storage.engine.stats import FSYNC_BUCKETS_S, Histograms

__all__ = ["PUBLISH_BUCKETS_S", "TAKEOVER_BUCKETS_S", "ReplicationStats"]

# A JetStream publish with 3 replicas is a quorum round trip: ~1 ms on one machine,
# more across zones; the same bounds as an fsync's.
PUBLISH_BUCKETS_S = FSYNC_BUCKETS_S
# A takeover replays the shard's stream since its last checkpoint: seconds.
TAKEOVER_BUCKETS_S: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(slots=True)
class ReplicationStats:
    """Per shard unless said otherwise; since this process started."""

    # Each JetStream publish of a log chunk, until its acknowledgement (retries included).
    publish: Histograms = field(default_factory=lambda: Histograms(PUBLISH_BUCKETS_S))
    # Leases won: every time this process acquired a shard (its first start included).
    takeovers: Counter[str] = field(default_factory=Counter)
    # Lease won to serving (the stream replayed, the node listening), per takeover.
    takeover_seconds: Histograms = field(default_factory=lambda: Histograms(TAKEOVER_BUCKETS_S))
    last_takeover_seconds: dict[str, float] = field(default_factory=dict)
    # Renewals that got no answer (NATS unreachable or slow); the lease may still hold.
    renewals_failed: Counter[str] = field(default_factory=Counter)
    # Renewals refused: the lease expired or another process holds it; the shard is gone.
    leases_lost: Counter[str] = field(default_factory=Counter)
    # Shards served here now, and the shards this process may serve (the pool's).
    owned: set[str] = field(default_factory=set)
    shards: int = 0

    def took_over(self, shard: str, seconds: float) -> None:
        """``shard`` is served here, ``seconds`` after its lease was won."""
        self.takeovers[shard] += 1
        self.takeover_seconds.observe(shard, seconds)
        self.last_takeover_seconds[shard] = seconds
        self.owned.add(shard)
        # Their series exist from now on, at 0 (Prometheus' advice for label sets).
        self.renewals_failed[shard] += 0
        self.leases_lost[shard] += 0
