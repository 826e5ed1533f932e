"""What handlers see: the listener's services shared by every Kafka connection, and the
one connection's session (who it is, where the client reached us)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from polymq.gateway.accounts import ANONYMOUS, Accounts, Principal
from polymq.gateway.config import LimitsConfig
from polymq.gateway.connections import ConnectionRegistry
from polymq.gateway.fairness import FrameBudget
from polymq.gateway.listeners import ListenerContext
from polymq.gateway.processor import Caller, Processor
from polymq.gateway.quotas import Quotas
from polymq.navigation.endpoints import GatewayDirectory, GatewayEndpoint
from polymq.protocols.kafka._state import AuthState
from polymq.protocols.kafka.cluster import ClusterView, DepartedBrokers, cluster_view
from polymq.protocols.kafka.compaction import Compactor
from polymq.protocols.kafka.consumer_groups import ConsumerGroups
from polymq.protocols.kafka.coordinator import GroupCoordinator
from polymq.protocols.kafka.producers import ProducerRegistry
from polymq.protocols.kafka.share_groups import ShareGroups
from polymq.protocols.kafka.transactions import TransactionState
from polymq.storage.model import QueueRef

__all__ = ["KafkaServices", "Session"]

PROTOCOL = "kafka"
# A request nests partitions in topics: room for max_batch_items partitions and as
# many topics (so one partition too many still gets Kafka's error) before decoding
# refuses.
ITEMS_PER_BATCH_ITEM = 2


class KafkaServices:
    """Shared by the connections of one listener: the processor, the group coordinator
    and idempotent-producer state (both in this gateway's memory)."""

    def __init__(self, context: ListenerContext) -> None:
        self.processor: Processor = context.processor
        self.accounts: Accounts = context.accounts
        self.connections: ConnectionRegistry = context.connections
        self.directory: GatewayDirectory = context.directory
        self.config = context.config.kafka
        self.limits: LimitsConfig = context.config.limits
        # Shared with every listener: bytes of request frames being read or handled.
        self.frame_budget: FrameBudget = context.frame_budget
        # Per-account rates (protocols/kafka/quota.py) and connection limits.
        self.quotas: Quotas = context.quotas
        # Kafka's connections.max.idle.ms: an idle socket holds a connection slot for
        # at most this long.
        self.idle_timeout_s: float = context.config.kafka.connections_max_idle_ms / 1000
        # Array items (topics, partitions, ...) one request may carry in all before it
        # is not even decoded: the handlers refuse more than max_batch_items partitions
        # with Kafka's per-partition error; this bounds the decoding time behind that,
        # which holds the loop (measured: 240 ms for a Fetch of 100,000 partitions, so
        # about 50 ms at the default).
        self.max_request_items = ITEMS_PER_BATCH_ITEM * self.limits.max_batch_items
        self.coordinator = GroupCoordinator(
            initial_rebalance_delay_ms=self.config.group_initial_rebalance_delay_ms
        )
        self.compactor = Compactor(self.processor)
        self.producers = ProducerRegistry(
            GatewayEndpoint(gateway_id=context.directory.self_id, host="", port=0).broker_id
        )
        self.transactions = TransactionState()
        self.consumer_groups = ConsumerGroups()
        self.share_groups = ShareGroups()
        self.topic_names: dict[uuid.UUID, str] = {}  # topic id -> name (a cache)
        # Gateways that just left the directory, per listener (each lists its own ports).
        self.departed: dict[str, DepartedBrokers] = {}

    def departed_from(self, listener: str) -> DepartedBrokers:
        return self.departed.setdefault(listener, DepartedBrokers())

    async def close(self) -> None:
        await self.coordinator.close()
        await self.compactor.close()


@dataclass(kw_only=True)
class Session:
    services: KafkaServices
    connection_id: int | None
    advertised: tuple[str, int]  # host and port this client reached us on
    state: AuthState
    caller: Caller
    client_id: str | None = None
    peer: str = ""  # the client's host, as Kafka shows it ("/127.0.0.1")
    sasl: Any = None  # the mechanism's exchange while HANDSHAKEN
    closing: bool = False  # close once the current response is written
    # What the current request's answer waits for after its handler returned (an
    # acks=all produce: its fsync); the connection answers in order meanwhile.
    answer_after: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    throttle_ms: int = 0  # not read for this long after the answer (KIP-219)
    listener: str = "kafka"  # whose endpoints Metadata names (kafka_tls: the TLS ones)

    @property
    def namespace(self) -> str:
        return self.caller.namespace

    @property
    def processor(self) -> Processor:
        return self.services.processor

    @property
    def cluster(self) -> ClusterView:
        """The gateways as Kafka brokers, for this client (read per request: the
        directory is a cache that changes as gateways come and go)."""
        return cluster_view(
            self.services.directory,
            self.advertised,
            self.services.departed_from(self.listener),
            listener=self.listener,
        )

    def owns(self, key: str) -> bool:
        """Whether this gateway coordinates ``key`` (a group or transactional id)."""
        return self.cluster.owns(key)

    def queue(self, topic: str, partition: int) -> QueueRef:
        return QueueRef(self.caller.namespace, topic, partition)

    def authenticated(self, principal: Principal) -> None:
        """Switch to ``principal``'s default namespace and record who this is."""
        self.caller = caller_for(principal, self.connection_id, self.client_id)
        self.state = AuthState.AUTHENTICATED
        self.sasl = None
        if self.connection_id is not None and self.services.connections.get(self.connection_id):
            self.services.connections.identify(
                self.connection_id,
                principal=principal,
                namespace=principal.default_namespace,
                client_id=self.client_id,
            )


def caller_for(principal: Principal, connection_id: int | None, client_id: str | None) -> Caller:
    return Caller(
        principal=principal,
        namespace=principal.default_namespace,
        protocol=PROTOCOL,
        connection_id=connection_id,
        client_id=client_id,
    )


def anonymous_caller(connection_id: int | None) -> Caller:
    return caller_for(ANONYMOUS, connection_id, None)
