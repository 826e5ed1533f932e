"""How storage nodes and gateways talk to the nameservers.

Nameservers do not talk to each other, so a node tells every one of them (a dead one
must never delay the others), while a question needs only one answer: it goes to the
nameserver that answered last, then to the others in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from ssl import SSLContext
from typing import Any

from polymq.storage.errors import StorageUnavailable
from polymq.storage.routes import NodeHeartbeat, RouteTable
from polymq.storage.rpc import RpcClient

__all__ = ["NameserverClient", "parse_address"]

log = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as a pair; ``ValueError`` naming it if
    it is not one."""
    host, sep, port = address.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"nameserver address {address!r} is not host:port")
    return host, int(port)


class NameserverClient:
    """One RPC connection per nameserver, opened on first use and again after a loss.

    ``timeout_s`` bounds every call, so a nameserver that accepts but never answers
    counts as down rather than stalling its caller."""

    def __init__(
        self, addresses: Sequence[str], *, timeout_s: float = 2.0, ssl: SSLContext | None = None
    ) -> None:
        if isinstance(addresses, str):  # a lone "host:port" would be split into chars
            addresses = [addresses]
        if not addresses:
            raise ValueError("no nameserver address given")
        # ``ssl``: TLS to every nameserver ([tls] internal).
        self._clients = [
            RpcClient(*parse_address(a), connect_timeout=timeout_s, ssl=ssl) for a in addresses
        ]
        self._timeout_s = timeout_s
        self._preferred = 0
        self._unreachable: set[str] = set()  # for logging changes only, not every beat

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(c.target for c in self._clients)

    async def heartbeat(self, hb: NodeHeartbeat) -> int:
        """Send ``hb`` to every nameserver at once; how many took it. Never raises: a
        nameserver that is down is logged (once, until it is back)."""
        answers = await asyncio.gather(
            *(self._beat(client, hb) for client in self._clients), return_exceptions=True
        )
        return sum(1 for a in answers if a is True)

    async def _beat(self, client: RpcClient, hb: NodeHeartbeat) -> bool:
        try:
            await self._call(client, "heartbeat", hb)
        except Exception as exc:  # whatever happened, the other nameservers go on
            self._note_down(client, exc)
            return False
        self._note_up(client)
        return True

    async def routes(self, since_version: int = 0) -> RouteTable | None:
        """The routes if they changed since ``since_version`` (0: none held yet)."""
        table: RouteTable | None = await self._ask("routes", since_version)
        return table

    async def place_topic(self, namespace: str, topic: str) -> str:
        node_id: str = await self._ask("place_topic", namespace, topic)
        return node_id

    async def place_home(self, namespace: str) -> str:
        node_id: str = await self._ask("place_home", namespace)
        return node_id

    async def status(self) -> RouteTable:
        table: RouteTable = await self._ask("status")
        return table

    async def _ask(self, method: str, *args: Any) -> Any:
        """The first answer, starting with the nameserver that answered last.
        ``StorageUnavailable`` (from a nameserver that cannot place, having no live
        node) also moves on: another may know more. Other errors are the caller's."""
        count = len(self._clients)
        failures = []
        for step in range(count):
            index = (self._preferred + step) % count
            client = self._clients[index]
            try:
                value = await self._call(client, method, *args)
            except (StorageUnavailable, TimeoutError) as exc:
                self._note_down(client, exc)
                failures.append(f"{client.target}: {exc or 'no answer'}")
                continue
            self._note_up(client)
            self._preferred = index
            return value
        raise StorageUnavailable(f"no nameserver answered {method}: {'; '.join(failures)}")

    async def _call(self, client: RpcClient, method: str, *args: Any) -> Any:
        """One call, bounded by the timeout. A connection that was open but turns out
        dead (the nameserver restarted since the last call) is found only by using it:
        that call is sent once more, on a fresh connection. Every method is safe to
        repeat."""
        was_connected = client.connected
        async with asyncio.timeout(self._timeout_s):
            try:
                return await client.call(method, *args)
            except StorageUnavailable:
                if not was_connected or client.connected:
                    raise
                return await client.call(method, *args)

    def _note_down(self, client: RpcClient, exc: BaseException) -> None:
        if client.target not in self._unreachable:
            self._unreachable.add(client.target)
            log.warning("nameserver %s: %s", client.target, exc or type(exc).__name__)

    def _note_up(self, client: RpcClient) -> None:
        if client.target in self._unreachable:
            self._unreachable.discard(client.target)
            log.info("nameserver %s answers again", client.target)

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients))
