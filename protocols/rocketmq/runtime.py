"""What every RocketMQ activity shares: the processor, options, who is calling, and
the topics it names (with RocketMQ's auto-create rule).

A request's caller comes from its gRPC metadata: the access key's account (its
signature checked against the secret), the namespace from the request's
``resource_namespace`` or ``x-mq-namespace`` (else the account's default), the client
id from ``x-mq-client-id``.

The class is ``RocketMQServices`` after the rule every protocol follows (one listener's
shared state is ``<Protocol>Services``); the module keeps its name because
``service.py`` beside it is the gRPC servicer, and a ``services.py`` would read as its
plural.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from rocketmq.grpc_protocol import Code

from polymq.gateway.accounts import Accounts, Principal
from polymq.gateway.config import GatewayConfig
from polymq.gateway.connections import ConnectionRegistry
from polymq.gateway.processor import Caller, Processor
from polymq.gateway.quotas import Quotas
from polymq.navigation.endpoints import GatewayDirectory
from polymq.protocols.rocketmq import auth
from polymq.protocols.rocketmq.filters import Filter, parse_filter
from polymq.protocols.rocketmq.options import RocketMQOptions
from polymq.protocols.rocketmq.renewal import ReceiptRenewer
from polymq.protocols.rocketmq.sessions import Sessions
from polymq.protocols.rocketmq.status import RpcFailure
from polymq.storage.errors import TopicAlreadyExists, TopicNotFound
from polymq.storage.model import MessageType, QueueRef, StoredMessage, TopicConfig, TopicInfo

__all__ = ["PROTOCOL", "RocketMQServices"]

PROTOCOL = "rocketmq"
_TOPIC_CACHE_S = 2.0
# Requests' verified identities are kept this long (clients sign with the second),
# and at most this many at once.
_CALLER_CACHE_S = 1.0
_CALLER_CACHE_SIZE = 4096


class RocketMQServices:
    def __init__(
        self,
        *,
        processor: Processor,
        accounts: Accounts,
        config: GatewayConfig,
        connections: ConnectionRegistry,
        options: RocketMQOptions,
        directory: GatewayDirectory | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.processor = processor
        self.quotas = quotas or Quotas()  # per-account rates (protocols.rocketmq.quota)
        # The live gateways (routes name them); None: this one alone.
        self.directory = directory
        self.accounts = accounts
        self.config = config
        self.options = options
        self.connections = connections
        self.sessions = Sessions(connections)
        self.renewer = ReceiptRenewer(
            processor, invisible_ms=options.default_invisible_ms, max_renew_ms=options.max_renew_ms
        )
        # Where the listener is bound: routes name it when the client did not say.
        self.address: tuple[str, int] = ("127.0.0.1", 0)
        # The listener whose gateways' endpoints routes name (rocketmq_tls: TLS ones).
        self.listener = "rocketmq"
        # Check-backs sent per undecided transaction: (namespace, transaction id).
        self.transaction_checks: dict[tuple[str, str], int] = {}
        # The last receive per (client id, group, topic): its attempt id and answer.
        self.receive_attempts: dict[
            tuple[str | None, str, str], tuple[str, list[StoredMessage]]
        ] = {}
        self._rotation = itertools.count()
        self._groups: set[tuple[str, str]] = set()
        self._topics: dict[tuple[str, str], tuple[float, TopicInfo]] = {}
        self._callers: dict[tuple[auth.RequestHeaders, str], tuple[float, Principal, str]] = {}

    @property
    def auto_create(self) -> bool:
        return self.config.rocketmq.auto_create

    @property
    def sync_flush(self) -> bool:
        """Whether a send waits for its fsync (``rocketmq.flush = "sync"``, Apache's
        SYNC_FLUSH); by default it is answered once written (ASYNC_FLUSH)."""
        return self.config.rocketmq.flush == "sync"

    @property
    def store_host(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    @property
    def max_body_bytes(self) -> int:
        return min(self.options.max_body_bytes, self.config.storage.max_message_bytes)

    def filter(self, filter_type: int, expression: str) -> Filter:
        """A subscription's filter, nested at most ``limits.max_nesting_depth`` deep
        (else ILLEGAL_FILTER_EXPRESSION)."""
        return parse_filter(filter_type, expression, max_depth=self.config.limits.max_nesting_depth)

    def client_gone(self, client_id: str) -> None:
        """Forget what was kept for a client whose session ended: its messages come
        back after their invisible time."""
        self.renewer.forget_client(client_id)
        for key in [k for k in self.receive_attempts if k[0] == client_id]:
            del self.receive_attempts[key]

    def rotate(self) -> int:
        """A counter for spreading messages without a group over a topic's queues."""
        return next(self._rotation)

    # -- who is calling --------------------------------------------------------------

    def caller(self, context: Any, namespace: str = "") -> Caller:
        """The caller of a request, or :class:`RpcFailure` (UNAUTHORIZED, FORBIDDEN).

        A client signs each request with the current second, so its requests within a
        second carry the same headers: who they are (the account, the signature's
        check, the namespace) is remembered for that second rather than worked out
        on every call."""
        try:
            headers = auth.read_headers(context.invocation_metadata() or ())
        except auth.SignatureError as e:
            raise RpcFailure(Code.UNAUTHORIZED, str(e)) from e
        key = (headers, namespace)
        now = time.monotonic()
        known = self._callers.get(key)
        if known is None or known[0] < now:
            if len(self._callers) >= _CALLER_CACHE_SIZE:
                self._callers.clear()
            known = (now + _CALLER_CACHE_S, *self._authenticate(headers, namespace))
            self._callers[key] = known
        _, principal, chosen = known
        session = self.sessions.get(headers.client_id) if headers.client_id else None
        return Caller(
            principal=principal,
            namespace=chosen,
            protocol=PROTOCOL,
            connection_id=session.connection_id if session is not None else None,
            client_id=headers.client_id,
        )

    def _authenticate(self, headers: auth.RequestHeaders, namespace: str) -> tuple[Principal, str]:
        """The account a request's signature names, and the namespace it may use."""
        key = self.accounts.access_key(headers.access_key)  # AuthenticationFailed
        if key.secret_key is not None:
            try:
                auth.verify(headers, key.secret_key)
                auth.check_date(
                    headers,
                    self.processor.clock.now_ms(),
                    behind_ms=self.options.signature_behind_ms,
                    ahead_ms=self.options.signature_ahead_ms,
                )
            except auth.SignatureError as e:
                raise RpcFailure(Code.UNAUTHORIZED, str(e)) from e
        principal = key.principal
        chosen = namespace or headers.namespace or principal.default_namespace
        if not principal.may_use(chosen):
            raise RpcFailure(Code.FORBIDDEN, f"{principal.name!r} may not use namespace {chosen!r}")
        return principal, chosen

    async def check_group(self, caller: Caller, group: str) -> None:
        """With auto-create off, a consumer group must have been created (given a
        config through the admin API) before it consumes: CONSUMER_GROUP_NOT_FOUND."""
        if not group:
            raise RpcFailure(Code.ILLEGAL_CONSUMER_GROUP, "consumer group is empty")
        # Every group request passes here: the permission model's read on the group
        # (FORBIDDEN otherwise, docs/permissions.md).
        await self.processor.authorize(caller, "group", group, "read")
        if self.auto_create or (caller.namespace, group) in self._groups:
            return
        if group not in await self.processor.list_groups(caller):
            raise RpcFailure(
                Code.CONSUMER_GROUP_NOT_FOUND, f"consumer group {group!r} does not exist"
            )
        self._groups.add((caller.namespace, group))

    # -- topics ----------------------------------------------------------------------

    async def find_topic(self, caller: Caller, topic: str) -> TopicInfo | None:
        """The topic, from a short cache (routes and sends ask for it on every call)."""
        if not topic:
            raise RpcFailure(Code.ILLEGAL_TOPIC, "topic name is empty")
        key = (caller.namespace, topic)
        cached = self._topics.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < _TOPIC_CACHE_S:
            return cached[1]
        try:
            info = await self.processor.describe_topic(caller, topic)
        except TopicNotFound:
            self._topics.pop(key, None)
            return None
        self._topics[key] = (now, info)
        return info

    async def topic(self, caller: Caller, topic: str, create_as: MessageType | None) -> TopicInfo:
        """The topic; created with ``create_as`` when missing and auto-create is on
        (``None``: never created here), else TOPIC_NOT_FOUND."""
        info = await self.find_topic(caller, topic)
        if info is not None:
            return info
        if create_as is None or not self.auto_create:
            raise RpcFailure(Code.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist")
        config = TopicConfig(queue_count=self.options.default_queue_count, message_type=create_as)
        try:
            info = await self.processor.create_topic(caller, topic, config)
        except TopicAlreadyExists:
            info = await self.processor.describe_topic(caller, topic)
        self._topics[(caller.namespace, topic)] = (time.monotonic(), info)
        return info

    @staticmethod
    def queues(info: TopicInfo, queue_id: int = -1) -> Sequence[QueueRef]:
        """Every queue of the topic for ``-1`` (a pop across the topic), else one."""
        count = info.config.queue_count
        if queue_id < 0 or queue_id >= count:
            return [QueueRef(info.namespace, info.name, q) for q in range(count)]
        return [QueueRef(info.namespace, info.name, queue_id)]
