"""A gateway's view of the other gateways, kept fresh from the navigation service.

Protocol handlers read :meth:`NavigationDirectory.endpoints` synchronously (a Kafka
Metadata answer must not wait on HTTP), so a background task heartbeats this gateway's
listeners and refreshes the lists every ``heartbeat_ms``. If navigation cannot be
reached the directory answers with this gateway alone: a client is then told of one
gateway that certainly works, and rendezvous ownership (``owner_of``) makes this
gateway the coordinator of everything it is asked about, which it can serve, rather
than a gateway that may be gone.

Each refresh also dials every peer once (:mod:`navigation.liveness`): a peer whose
listener refuses the connection has died, and is left out of the lists from then
until it accepts again, instead of until navigation's expiry. Without that, Kafka
clients told that a killed gateway leads a partition stalled for the whole expiry.
A handler may also ask for a fresh look (:meth:`NavigationDirectory.check_peers`):
a Kafka client asks Metadata within milliseconds of losing a gateway, sooner than
the next refresh, and should hear of the death in that very answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from ssl import SSLContext
from typing import Any
from urllib.parse import quote

import httpx

from polymq.navigation.endpoints import GatewayEndpoint
from polymq.navigation.liveness import probe_targets, refusing
from polymq.storage.lifecycle import Service

__all__ = ["NavigationDirectory"]

log = logging.getLogger(__name__)


class NavigationDirectory(Service):
    """Implements :class:`gateway.directory.RegisteredDirectory`.

    ``endpoints``: this gateway's listeners by protocol, asked at every heartbeat
    (they are known only once the listeners are bound). ``load``: a figure navigation
    sorts by, lower is better (open connections, say). ``probe_peers``: dial the
    peers at each refresh and leave out those that refuse (off only where peers are
    made-up addresses, in tests)."""

    def __init__(
        self,
        url: str,
        *,
        gateway_id: str,
        zone: str = "",
        endpoints: Callable[[], Mapping[str, GatewayEndpoint]],
        load: Callable[[], float] = lambda: 0.0,
        heartbeat_ms: int = 1000,
        probe_peers: bool = True,
        ssl: SSLContext | None = None,
    ) -> None:
        super().__init__()
        self._url = url.rstrip("/")
        # An https:// navigation URL's trust (and client certificate): [tls] internal.
        self._ssl = ssl
        self._id = gateway_id
        self._zone = zone
        self._own = endpoints
        self._load = load
        self._interval_s = heartbeat_ms / 1000
        # Slower than an interval is as bad as no answer: the next beat is due.
        self._timeout_s = min(5.0, max(0.5, 2 * self._interval_s))
        # A refusal is immediate; a peer slower than this to accept is left to the
        # expiry, and the next heartbeat is held up by at most about an interval.
        self._probe_timeout_s = min(0.5, max(0.1, self._interval_s)) if probe_peers else None
        self._lists: dict[str, tuple[GatewayEndpoint, ...]] = {}
        self._refused: frozenset[str] = frozenset()  # peers whose listener refused
        self._probed_at = -1e9  # monotonic start of the last round of dials
        self._probing: asyncio.Future[None] | None = None  # the round in flight
        self._reachable = False
        self._failing = False
        self._http: httpx.AsyncClient | None = None

    @property
    def self_id(self) -> str:
        return self._id

    @property
    def reachable(self) -> bool:
        """Whether the last exchange with navigation succeeded."""
        return self._reachable

    def endpoints(self, protocol: str) -> Sequence[GatewayEndpoint]:
        own = self._own().get(protocol)
        if own is not None:
            own = GatewayEndpoint(
                gateway_id=self._id,
                host=own.host,
                port=own.port,
                zone=self._zone,
                load=float(self._load()),
            )
        listed = self._lists.get(protocol, ()) if self._reachable else ()
        if self._refused:
            listed = tuple(e for e in listed if e.gateway_id not in self._refused)
        if own is None or any(e.gateway_id == self._id for e in listed):
            return listed
        return (*listed, own)

    async def start(self) -> None:
        """Register at once (so other gateways see this one within a round trip) and
        keep doing it in the background. Never fails for navigation being down."""
        if self._http is not None:
            return
        self._http = httpx.AsyncClient(
            base_url=self._url,
            timeout=self._timeout_s,
            verify=self._ssl if self._ssl is not None else True,
        )
        await self._exchange()
        self.tasks.spawn(self._run(), name="navigation heartbeat")

    async def close(self) -> None:
        """Stop heartbeating and deregister, so clients stop being sent here now
        rather than after the expiry."""
        await super().close()  # first: a beat after the deregistration would undo it
        http, self._http = self._http, None
        if http is None:
            return
        try:
            # Bounded tighter than a beat: a stopping gateway should not hang on it.
            response = await http.delete(
                f"/v1/gateways/{quote(self._id, safe='')}", timeout=min(1.0, self._timeout_s)
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.info("navigation %s: could not deregister %s: %s", self._url, self._id, exc)
        finally:
            await http.aclose()
            self._reachable = False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._exchange()
            except Exception:  # our bug: logged loudly, and the beats go on
                log.exception("navigation %s: heartbeat failed", self._url)
                self._reachable = False

    async def _exchange(self) -> None:
        """One heartbeat and one refresh of every protocol this gateway serves."""
        http = self._http
        if http is None:
            return
        own = self._own()
        try:
            response = await http.post("/v1/gateways/heartbeat", json=self._heartbeat(own))
            response.raise_for_status()
            answers = await asyncio.gather(
                *(
                    http.get("/v1/endpoints", params={"protocol": protocol, "zone": self._zone})
                    for protocol in own
                )
            )
            lists = {}
            for protocol, answer in zip(own, answers, strict=True):
                answer.raise_for_status()
                lists[protocol] = _parse_endpoints(answer.json())
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if not self._failing:  # logged once per outage, not at every beat
                log.warning("navigation %s: %r; listing this gateway alone", self._url, exc)
            self._reachable, self._failing = False, True
            return
        if not self._reachable:
            log.info("navigation %s: registered %s", self._url, self._id)
        self._lists, self._reachable, self._failing = lists, True, False
        await self._probe(lists)

    async def check_peers(self, *, max_age_s: float, timeout_s: float) -> None:
        """Dial the peers now unless a round began within ``max_age_s`` (callers at the
        same moment share one round); a peer slower than ``timeout_s`` to answer
        counts as alive. Never raises: a failed look leaves the lists as they were."""
        if self._probe_timeout_s is None or not self._reachable:
            return
        if self._probing is None:
            if time.monotonic() - self._probed_at < max_age_s:
                return
            self._probing = asyncio.ensure_future(self._probe(self._lists, timeout_s))
            self._probing.add_done_callback(self._probed)
        with contextlib.suppress(Exception):
            await asyncio.shield(self._probing)

    def _probed(self, done: asyncio.Future[None]) -> None:
        self._probing = None
        if not done.cancelled() and done.exception() is not None:
            log.error("probing the peer gateways failed", exc_info=done.exception())

    async def _probe(
        self, lists: Mapping[str, Sequence[GatewayEndpoint]], timeout_s: float | None = None
    ) -> None:
        """Dial every peer; note which refuse, and log each change once."""
        if self._probe_timeout_s is None:
            return
        self._probed_at = time.monotonic()
        targets = probe_targets(lists, self._id)
        refused = frozenset(await refusing(targets, timeout_s or self._probe_timeout_s))
        for peer in sorted(refused - self._refused):
            host, port = targets[peer]
            log.info("gateway %s refuses connections at %s:%d: not offering it", peer, host, port)
        for peer in sorted(self._refused - refused):
            if peer in targets:
                log.info("gateway %s accepts connections again", peer)
        self._refused = refused

    def _heartbeat(self, own: Mapping[str, GatewayEndpoint]) -> dict[str, Any]:
        return {
            "gateway_id": self._id,
            "zone": self._zone,
            "load": float(self._load()),
            "endpoints": [
                {"protocol": protocol, "host": e.host, "port": e.port}
                for protocol, e in own.items()
            ],
        }


def _parse_endpoints(body: Any) -> tuple[GatewayEndpoint, ...]:
    return tuple(
        GatewayEndpoint(
            gateway_id=str(e["gateway_id"]),
            host=str(e["host"]),
            port=int(e["port"]),
            zone=str(e["zone"]),
            load=float(e["load"]),
        )
        for e in body["endpoints"]
    )
