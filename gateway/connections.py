"""The registry of open client connections, across all protocols.

One place to enforce the connection limits (in all, per protocol, per source address),
to list who is connected (admin API, dashboard), to count connections per tenant for
metering, to know which connections finished their handshake, and to close everything
on shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace

from polymq.gateway.accounts import Principal
from polymq.gateway.metering import Metering
from polymq.gateway.quotas import Quotas
from polymq.storage.clock import Clock

__all__ = [
    "OUT_NOT_PER_CONNECTION",
    "AccountConnectionLimit",
    "CloseCallback",
    "Connection",
    "ConnectionRegistry",
    "TooManyConnections",
    "Traffic",
    "current_connection_id",
    "peer_host",
    "serve_connection",
    "serving_connection",
]

log = logging.getLogger(__name__)

CloseCallback = Callable[[], Awaitable[None]]

# Set by the transport for the task that serves one connection, so a protocol
# handler finds its registry entry without changing the handler's signature.
_current: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "polymq_connection_id", default=None
)


def current_connection_id() -> int | None:
    """The registry id of the connection the running task serves, if any."""
    return _current.get()


class TooManyConnections(Exception):
    code = "too_many_connections"


class AccountConnectionLimit(TooManyConnections):
    """The account already has its quota's ``connections`` open here: the protocol
    refuses the login with its own error (docs/quotas.md)."""

    code = "account_connection_limit"


def peer_host(peer: str) -> str:
    """The address part of a ``host:port`` or ``[v6]:port`` peer, which per-address
    limits count by."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        return peer
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass(frozen=True, slots=True, kw_only=True)
class Connection:
    """A connection as listed. ``principal`` and ``namespace`` are ``None`` until the
    protocol has authenticated the peer (:meth:`ConnectionRegistry.identify`)."""

    id: int
    protocol: str
    peer: str
    opened_ms: int
    principal: Principal | None = None
    namespace: str | None = None
    client_id: str | None = None
    # The consumer group the client consumes for, when its protocol says so on the
    # connection (RocketMQ's settings): the admin API's group members.
    group: str | None = None
    # Whether it came over TLS; None where the transport does not say (the console
    # shows "?" rather than a wrong "no"). ``certificate``: the verified client
    # certificate's subject common name, if it sent one.
    tls: bool | None = None
    certificate: str | None = None
    # Whether it finished its protocol's handshake and login (no handshake deadline
    # then): a field rather than a set of ids beside the records, which weighed
    # about 50 B of every idle connection.
    established: bool = False


# Protocols whose deliveries metering counts in another connection's task: MQTT
# fans a publish out to its subscribers in the publisher's task, so the publisher's
# connection would be credited with their messages. Their "out" is not counted per
# connection (the admin API lists it as null) until the protocol counts it for the
# subscriber's connection itself.
OUT_NOT_PER_CONNECTION = frozenset({"mqtt"})


class Traffic:
    """A connection's messages and bytes in and out, as metering counted them while
    its task served it (:meth:`ConnectionRegistry.count_traffic`): plain ints, one
    object per connection, added to once per metered batch."""

    __slots__ = ("bytes_in", "bytes_out", "messages_in", "messages_out", "protocol")

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol  # the connection's: what metering counts under others is not
        self.messages_in = self.bytes_in = self.messages_out = self.bytes_out = 0


class ConnectionRegistry:
    """Open connections. ``max_per_protocol`` and ``max_per_address`` default to
    ``max_connections`` (no tighter limit): idle sockets of one protocol, or of one
    address, then cannot take every slot from the others."""

    def __init__(
        self,
        *,
        max_connections: int,
        metering: Metering,
        clock: Clock,
        max_per_protocol: int | None = None,
        max_per_address: int | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self._max = max_connections
        # Per-account connection limits, checked when a connection says who it is.
        self._quotas = quotas
        self._per_account: collections.Counter[str] = collections.Counter()
        self._max_per_protocol = max_per_protocol or max_connections
        self._max_per_address = max_per_address or max_connections
        self._metering = metering
        self._clock = clock
        self._ids = itertools.count(1)
        self._open: dict[int, Connection] = {}
        self._close: dict[int, CloseCallback] = {}
        self._per_protocol: collections.Counter[str] = collections.Counter()
        self._per_address: collections.Counter[str] = collections.Counter()
        self._traffic: dict[int, Traffic] = {}
        metering.per_connection = self.count_traffic

    def count_traffic(
        self, protocol: str, messages_in: int, bytes_in: int, messages_out: int, bytes_out: int
    ) -> None:
        """Add what metering just counted to the connection the running task serves
        (:func:`current_connection_id`, set by the TCP transports): the admin API's
        per-connection rates at the cost of a dict lookup per metered batch. Work done
        outside a connection's task (HTTP requests, RocketMQ's gRPC calls) counts for
        no connection; so do a protocol's own bookkeeping records metered under another
        name (``amqp.changes``, AMQP's declarations), which are not the client's
        messages."""
        connection_id = _current.get()
        if connection_id is None:
            return
        traffic = self._traffic.get(connection_id)
        if traffic is None:
            conn = self._open.get(connection_id)
            if conn is None or conn.protocol != protocol:
                return  # counted after it closed, or not the client's messages
            # Made on the first count: a connection nothing was ever counted for
            # lists none rather than zeros that an HTTP or gRPC one could not change.
            traffic = self._traffic[connection_id] = Traffic(protocol)
        elif traffic.protocol != protocol:
            return
        traffic.messages_in += messages_in
        traffic.bytes_in += bytes_in
        if protocol not in OUT_NOT_PER_CONNECTION:
            traffic.messages_out += messages_out
            traffic.bytes_out += bytes_out

    def traffic(self, connection_id: int) -> Traffic | None:
        """What :meth:`count_traffic` counted for a connection so far; None before its
        first count."""
        return self._traffic.get(connection_id)

    def __len__(self) -> int:
        return len(self._open)

    def register(
        self,
        *,
        protocol: str,
        peer: str,
        close: CloseCallback,
        principal: Principal | None = None,
        namespace: str | None = None,
        client_id: str | None = None,
        tls: bool | None = None,
        certificate: str | None = None,
    ) -> Connection:
        """Admit a connection, or raise :class:`TooManyConnections` at the limit (the
        caller then closes the socket: refusing early costs less than serving).
        ``tls`` and ``certificate`` are what the transport knows of its TLS."""
        if len(self._open) >= self._max:
            raise TooManyConnections(f"connection limit of {self._max} reached")
        if self._per_protocol[protocol] >= self._max_per_protocol:
            raise TooManyConnections(
                f"{protocol} connection limit of {self._max_per_protocol} reached"
            )
        address = peer_host(peer)
        if self._per_address[address] >= self._max_per_address:
            raise TooManyConnections(
                f"connection limit of {self._max_per_address} per address reached for {address}"
            )
        if principal is not None:
            self._admit_account(principal, protocol)
        conn = Connection(
            id=next(self._ids),
            protocol=protocol,
            peer=peer,
            opened_ms=self._clock.now_ms(),
            principal=principal,
            namespace=namespace,
            client_id=client_id,
            tls=tls,
            certificate=certificate,
        )
        self._open[conn.id] = conn
        self._close[conn.id] = close
        self._per_protocol[protocol] += 1
        self._per_address[address] += 1
        if principal is not None:
            self._per_account[principal.name] += 1
        if namespace is not None:
            self._metering.connection_opened(namespace, protocol)
        return conn

    def at_account_limit(self, principal: Principal) -> bool:
        """Whether ``principal`` has its quota's connections open already (for
        protocols whose requests may come outside a registered connection)."""
        limit = self._quotas.connection_limit(principal) if self._quotas is not None else None
        return limit is not None and self._per_account[principal.name] >= limit

    def _admit_account(self, principal: Principal, protocol: str) -> None:
        """Raise :class:`AccountConnectionLimit` if ``principal`` has its quota's
        connections open already (and count the refusal)."""
        if self._quotas is None:
            return
        limit = self._quotas.connection_limit(principal)
        if limit is not None and self._per_account[principal.name] >= limit:
            self._quotas.of(principal).refused(protocol)
            raise AccountConnectionLimit(
                f"connection limit of {limit} reached for user {principal.name!r}"
            )

    def established(self, connection_id: int) -> None:
        """The connection finished its protocol's handshake and login: the handshake
        deadline no longer applies (:meth:`identify` implies it)."""
        conn = self._open.get(connection_id)
        if conn is not None and not conn.established:
            self._open[connection_id] = replace(conn, established=True)

    def is_established(self, connection_id: int) -> bool:
        conn = self._open.get(connection_id)
        return conn is not None and conn.established

    def identify(
        self,
        connection_id: int,
        *,
        principal: Principal,
        namespace: str,
        client_id: str | None = None,
    ) -> Connection:
        """Record who a connection turned out to be, once the protocol knows; raises
        :class:`AccountConnectionLimit` (changing nothing) if that account has its
        quota's connections open already."""
        old = self._open[connection_id]
        changed = old.principal is None or old.principal.name != principal.name
        if changed:
            self._admit_account(principal, old.protocol)
        new = replace(
            old,
            principal=principal,
            namespace=namespace,
            client_id=client_id or old.client_id,
            established=True,
        )
        self._open[connection_id] = new
        if changed:
            if old.principal is not None:
                _decrement(self._per_account, old.principal.name)
            self._per_account[principal.name] += 1
        if old.namespace != namespace:
            if old.namespace is not None:
                self._metering.connection_closed(old.namespace, old.protocol)
            self._metering.connection_opened(namespace, old.protocol)
        return new

    def unregister(self, connection_id: int) -> None:
        """Forget a connection; a second call is harmless (close paths race)."""
        conn = self._open.pop(connection_id, None)
        self._close.pop(connection_id, None)
        self._traffic.pop(connection_id, None)
        if conn is None:
            return
        _decrement(self._per_protocol, conn.protocol)
        _decrement(self._per_address, peer_host(conn.peer))
        if conn.principal is not None:
            _decrement(self._per_account, conn.principal.name)
        if conn.namespace is not None:
            self._metering.connection_closed(conn.namespace, conn.protocol)

    def get(self, connection_id: int) -> Connection | None:
        return self._open.get(connection_id)

    def consumes_for(self, connection_id: int, group: str | None) -> None:
        """Record the consumer group a connection's client consumes for."""
        old = self._open.get(connection_id)
        if old is not None:
            self._open[connection_id] = replace(old, group=group)

    def list(
        self, *, protocol: str | None = None, namespace: str | None = None
    ) -> list[Connection]:
        return [
            c
            for c in self._open.values()
            if (protocol is None or c.protocol == protocol)
            and (namespace is None or c.namespace == namespace)
        ]

    def count(self, *, protocol: str | None = None, namespace: str | None = None) -> int:
        return len(self.list(protocol=protocol, namespace=namespace))

    async def close(self, connection_id: int) -> None:
        """Close one connection through its transport (an admin's kick)."""
        callback = self._close.get(connection_id)
        self.unregister(connection_id)
        if callback is not None:
            await callback()

    async def close_all(self) -> None:
        """Close every connection concurrently. A failing close is logged, not raised:
        shutdown must go on to close storage."""
        ids = list(self._open)
        callbacks = [self._close[i] for i in ids]
        for i in ids:
            self.unregister(i)
        results = await asyncio.gather(*(cb() for cb in callbacks), return_exceptions=True)
        for conn_id, result in zip(ids, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("closing connection %d failed", conn_id, exc_info=result)


def _decrement(counter: collections.Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]  # addresses come and go: keep only those with connections


def serve_connection(connection_id: int) -> None:
    """Make :func:`current_connection_id` answer ``connection_id`` for the rest of the
    running task, whose own context ends with it: :func:`serving_connection` without a
    context manager kept for the connection's life (about 340 bytes per idle MQTT
    connection, whose task lives as long as the connection)."""
    _current.set(connection_id)


@contextlib.contextmanager
def serving_connection(connection_id: int) -> Iterator[None]:
    """Make :func:`current_connection_id` answer ``connection_id`` within the block
    (the transport wraps each connection's handler in it)."""
    token = _current.set(connection_id)
    try:
        yield
    finally:
        _current.reset(token)
