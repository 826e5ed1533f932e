"""The replicated pool: the engine's log kept in NATS JetStream (Raft-replicated
streams), shard ownership as leases in JetStream's key-value store, checkpoints in its
object store. See docs/replication.md."""
