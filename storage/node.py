"""A storage node (``polymq storage``): one embedded engine served to gateways over the
storage RPC, reporting itself to every nameserver.

Nameservers hold only soft state, so the node's heartbeat says everything routing
needs: every topic it holds and every namespace it is home to (whose namespace-wide
data, such as protocol metadata and keyed latest values, lives here). A heartbeat goes
out every ``heartbeat_ms`` and also at once after a change (a topic created or
deleted, a home claimed), so gateways find a new topic's node without waiting.

Each nameserver is sent to by its own task holding only the latest heartbeat: one
that is down or slow never delays the others, nor piles up stale heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from ssl import SSLContext
from typing import Any

from polymq.nameserver.client import NameserverClient
from polymq.storage.api import StorageAPI
from polymq.storage.engine import Engine
from polymq.storage.engine.ids import load_node_id
from polymq.storage.errors import NamespaceAlreadyExists
from polymq.storage.lifecycle import Service
from polymq.storage.names import check_name
from polymq.storage.routes import NodeHeartbeat
from polymq.storage.rpc import Handler, RpcServer

__all__ = ["SERVED_METHODS", "StorageNode"]

log = logging.getLogger(__name__)

# Every storage API call but the lifecycle, which is the node's own business.
SERVED_METHODS: tuple[str, ...] = tuple(
    sorted(
        name
        for name in vars(StorageAPI)
        if not name.startswith("_") and name not in ("start", "close")
    )
)

_MIN_BEAT_GAP_S = 0.05
# How long a topic's creation waits for the nameservers to hear of it; one that is
# down is then left to the regular beats.
_ANNOUNCE_TIMEOUT_S = 1.0
HOME_KIND = "_cluster"  # metadata kind marking, inside a namespace, that it lives here
_HOME_NAME = "home"


class StorageNode(Service):
    """Serves ``engine`` on ``host:port`` (port 0: any free port, see :attr:`address`)
    and heartbeats ``nameservers`` ("host:port" each). ``node_id`` defaults to the
    engine's own id, kept in its data directory, so it survives restarts.
    ``advertised_host`` is what gateways are told to dial (default: ``host``)."""

    def __init__(
        self,
        engine: Engine,
        node_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        nameservers: Sequence[str] = (),
        heartbeat_ms: int = 1000,
        *,
        advertised_host: str | None = None,
        epoch: int = 0,
        owner: str = "",
        server_ssl: SSLContext | None = None,
        client_ssl: SSLContext | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        # The replicated pool's lease epoch and shard owner (routes.NodeHeartbeat).
        self.epoch = epoch
        self.owner = owner
        self._node_id = node_id
        self.nameservers = tuple(nameservers)
        self.heartbeat_ms = heartbeat_ms
        self.advertised_host = advertised_host or host
        self._homes: set[str] = set()
        self._started_ms = 0
        # [tls] internal: gateways reach the node over TLS (``server_ssl``, mutual when
        # it asks), the node reaches the nameservers over TLS (``client_ssl``).
        self._server = RpcServer(self._handlers(), host, port, ssl=server_ssl)
        self._client_ssl = client_ssl
        self._changed = asyncio.Event()
        # Changes counted, so a topic's creator can wait until the nameservers heard of
        # it: a gateway asking them right after the creation then finds its route.
        self._change_count = 0
        self._slots: list[_LatestSlot] = []
        self._load_sample = (0, 0)  # (ms, requests served) at the last load figure
        self._load = 0.0

    @property
    def node_id(self) -> str:
        if self._node_id is None:
            raise RuntimeError("the node id is known once the node has started")
        return self._node_id

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the real port when configured with 0)."""
        return self._server.address

    @property
    def homes(self) -> frozenset[str]:
        return frozenset(self._homes)

    @property
    def requests_served(self) -> int:
        """Requests received since start (each counted when it begins)."""
        return self._server.requests_served

    def _handlers(self) -> dict[str, Handler]:
        handlers: dict[str, Handler] = {name: getattr(self.engine, name) for name in SERVED_METHODS}
        for name in ("create_topic", "delete_topic", "create_namespace", "delete_namespace"):
            handlers[name] = self._announcing(name)
        handlers["claim_home"] = self.claim_home
        handlers["node_info"] = self.node_info
        return handlers

    def _announcing(self, name: str) -> Handler:
        """The engine's method, followed by a heartbeat when it succeeded: routes
        change with it."""
        method = getattr(self.engine, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await method(*args, **kwargs)
            if name == "delete_namespace" and args:
                self._homes.discard(args[0])
            await self._announce()
            return result

        return call

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the engine, listen, and start heartbeating."""
        await self.engine.start()
        if self._node_id is None:
            self._node_id = load_node_id(Path(self.engine.config.data_dir)).hex()
        self._started_ms = self.engine.clock.now_ms()
        for namespace in await self.engine.list_namespaces():
            if await self.engine.meta_get(namespace, HOME_KIND, _HOME_NAME) is not None:
                self._homes.add(namespace)
        try:
            await self._server.start()
        except BaseException:  # the port is taken: leave nothing open behind
            await self.engine.close()
            raise
        if self.nameservers:
            slots = self._slots = [_LatestSlot() for _ in self.nameservers]
            self.tasks.spawn(self._beat_loop(slots), name="polymq-node-heartbeat")
            for address, slot in zip(self.nameservers, slots, strict=True):
                client = NameserverClient([address], ssl=self._client_ssl)
                self.tasks.spawn(_send_loop(client, slot))

    async def close(self, grace: float = 0.0) -> None:
        """Stop heartbeating and serving (requests in flight are cancelled, their
        connections dropped; with ``grace``, a hand-over, as ``RpcServer.close``
        says), then close the engine."""
        await super().close()  # first: the heartbeats, so none says a closing node is up
        await self._server.close(grace)
        await self.engine.close()

    # -- the node's own calls --------------------------------------------------------

    async def claim_home(self, namespace: str) -> None:
        """Keep ``namespace``'s namespace-wide data here from now on (idempotent). The
        claim is stored in the namespace itself, so it outlives restarts."""
        check_name("namespace", namespace)
        if namespace in self._homes:
            return
        with contextlib.suppress(NamespaceAlreadyExists):
            await self.engine.create_namespace(namespace)
        await self.engine.meta_put(
            namespace, HOME_KIND, _HOME_NAME, {"claimed_ms": self.engine.clock.now_ms()}
        )
        self._homes.add(namespace)
        await self._announce()

    async def node_info(self) -> NodeHeartbeat:
        """The heartbeat as it would be sent now."""
        topics: list[tuple[str, str]] = []
        for namespace in await self.engine.list_namespaces():
            for info in await self.engine.list_topics(namespace, include_internal=True):
                topics.append((namespace, info.name))
        return NodeHeartbeat(
            node_id=self.node_id,
            host=self.advertised_host,
            port=self.address[1],
            topics=tuple(topics),
            homes=tuple(sorted(self._homes)),
            # placement wants the emptiest node: topics held, plus a little for traffic
            load=len(topics) + self._request_rate() / 1000,
            disk_free_bytes=_disk_free(Path(self.engine.config.data_dir)),
            started_ms=self._started_ms,
            epoch=self.epoch,
            owner=self.owner,
        )

    def _request_rate(self) -> float:
        """Requests per second since the previous figure (at most one per second)."""
        now = self.engine.clock.now_ms()
        then, served_then = self._load_sample
        if now - then >= 1000:
            served = self._server.requests_served
            if then:
                self._load = (served - served_then) * 1000 / (now - then)
            self._load_sample = (now, served)
        return self._load

    # -- heartbeats ------------------------------------------------------------------

    async def _announce(self) -> None:
        """Beat at once and wait (bounded) until every nameserver took a heartbeat
        that includes this change; one that is down is not waited for longer."""
        self._change_count += 1
        change = self._change_count
        self._changed.set()
        if self._slots:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_ANNOUNCE_TIMEOUT_S):
                    await asyncio.gather(*(slot.delivered(change) for slot in self._slots))

    async def _beat_loop(self, slots: list[_LatestSlot]) -> None:
        loop = asyncio.get_running_loop()
        min_gap = min(_MIN_BEAT_GAP_S, self.heartbeat_ms / 1000)
        while True:
            self._changed.clear()
            sent = loop.time()
            change = self._change_count
            try:
                heartbeat = await self.node_info()
            except Exception:  # never let a bad moment stop the heartbeats for good
                log.exception("storage node: cannot build a heartbeat")
            else:
                for slot in slots:
                    slot.put(heartbeat, change)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_ms / 1000):
                    await self._changed.wait()
            # A burst of changes (MQTT sessions created by a flood of connects) shares
            # beats: the first change after a quiet spell goes out at once, then at
            # most one beat per gap.
            await asyncio.sleep(max(0.0, sent + min_gap - loop.time()))


class _LatestSlot:
    """The newest heartbeat for one nameserver; older unsent ones are dropped.
    ``change``: how many changes the heartbeat includes, so announcers can wait for
    theirs to be delivered."""

    def __init__(self) -> None:
        self.value: NodeHeartbeat | None = None
        self.change = 0
        self.ready = asyncio.Event()
        self._delivered = 0
        self._progress = asyncio.Condition()

    def put(self, value: NodeHeartbeat, change: int) -> None:
        self.value, self.change = value, change
        self.ready.set()

    async def take(self) -> tuple[NodeHeartbeat, int]:
        await self.ready.wait()
        self.ready.clear()
        assert self.value is not None
        return self.value, self.change

    async def mark_delivered(self, change: int) -> None:
        async with self._progress:
            self._delivered = max(self._delivered, change)
            self._progress.notify_all()

    async def delivered(self, change: int) -> None:
        async with self._progress:
            await self._progress.wait_for(lambda: self._delivered >= change)


async def _send_loop(client: NameserverClient, slot: _LatestSlot) -> None:
    """``client`` is a one-address ``NameserverClient``: it logs failures (once until
    the nameserver is back) and bounds each call with its own timeout."""
    try:
        while True:
            heartbeat, change = await slot.take()
            if await client.heartbeat(heartbeat):
                await slot.mark_delivered(change)
    finally:
        await client.close()


def _disk_free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0
