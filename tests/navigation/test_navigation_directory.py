"""Gateways' directories against a real navigation server on a free port: they find
each other, a clean stop is seen at once, a silent gateway drops out after the expiry,
a peer whose listener refuses connections drops out before it, and without navigation
a gateway lists itself alone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import httpx
import pytest

from polymq.navigation.directory import NavigationDirectory
from polymq.navigation.endpoints import GatewayDirectory, GatewayEndpoint, RegisteredDirectory
from polymq.navigation.liveness import probe_targets
from polymq.navigation.server import NavigationServer
from polymq.storage.clock import SystemClock

WAIT_S = 10.0
BEAT_MS = 50


def listeners(gateway_id: str, **ports: int) -> Callable[[], Mapping[str, GatewayEndpoint]]:
    def own() -> Mapping[str, GatewayEndpoint]:
        return {
            protocol: GatewayEndpoint(gateway_id=gateway_id, host="127.0.0.1", port=port)
            for protocol, port in ports.items()
        }

    return own


def directory(
    url: str, gateway_id: str, zone: str = "z", *, probe: bool = False, **ports: int
) -> NavigationDirectory:
    """``probe`` off by default: most tests list made-up ports nothing listens on."""
    return NavigationDirectory(
        url,
        gateway_id=gateway_id,
        zone=zone,
        endpoints=listeners(gateway_id, **ports),
        load=lambda: float(len(gateway_id)),
        heartbeat_ms=BEAT_MS,
        probe_peers=probe,
    )


@contextlib.asynccontextmanager
async def started(*directories: NavigationDirectory) -> AsyncIterator[None]:
    try:
        for d in directories:
            await d.start()
        yield
    finally:
        for d in directories:
            await d.close()


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.01)


def ids(d: GatewayDirectory, protocol: str) -> list[str]:
    return [e.gateway_id for e in d.endpoints(protocol)]


# Long enough that a gateway never expires by accident on a loaded machine (the
# directories beat every 50 ms); the expiry test uses a server of its own.
EXPIRY_MS = 5000


@pytest.fixture
async def navigation() -> AsyncIterator[NavigationServer]:
    async with NavigationServer(gateway_expiry_ms=EXPIRY_MS) as server:
        yield server


async def test_two_gateways_see_each_other_and_a_clean_stop(navigation: NavigationServer) -> None:
    one = directory(navigation.url, "g-one", kafka=9001, amqp=5001)
    two = directory(navigation.url, "g-two", kafka=9002)
    assert isinstance(one, RegisteredDirectory)
    async with started(one):
        async with started(two):
            await until(lambda: ids(one, "kafka") == ["g-one", "g-two"])  # least loaded
            await until(lambda: ids(two, "kafka") == ["g-one", "g-two"])
            kafka = {e.gateway_id: (e.host, e.port, e.zone) for e in two.endpoints("kafka")}
            assert kafka == {"g-one": ("127.0.0.1", 9001, "z"), "g-two": ("127.0.0.1", 9002, "z")}
            assert ids(one, "amqp") == ["g-one"]
            assert two.endpoints("amqp") == ()  # two serves no AMQP, one is not asked
            assert one.self_id == "g-one"
        # two closed: deregistered (an expired gateway would still be listed, as
        # unhealthy, by /v1/gateways; a deleted one is not).
        listed = [r.gateway_id for r in navigation.registry.gateways(0)]
        assert listed == ["g-one"]
        await until(lambda: ids(one, "kafka") == ["g-one"])


async def test_a_silent_gateway_drops_out_after_the_expiry() -> None:
    async with (
        NavigationServer(gateway_expiry_ms=500) as navigation,
        httpx.AsyncClient(base_url=navigation.url) as http,
    ):
        one = directory(navigation.url, "g-one", kafka=9001)
        async with started(one):
            # A gateway that heartbeats once and then dies without a word (SIGKILL).
            response = await http.post(
                "/v1/gateways/heartbeat",
                json={
                    "gateway_id": "g-dead",
                    "zone": "z",
                    "load": 0,
                    "endpoints": [{"protocol": "kafka", "host": "127.0.0.1", "port": 9009}],
                },
            )
            assert response.status_code == 200
            await until(lambda: ids(one, "kafka") == ["g-dead", "g-one"])
            await until(lambda: ids(one, "kafka") == ["g-one"])


async def test_any_gateway_id_deregisters(navigation: NavigationServer) -> None:
    odd = directory(navigation.url, "10.0.0.1:9092/a b%2F?#", kafka=1)
    async with started(odd):
        await until(lambda: ids(odd, "kafka") == ["10.0.0.1:9092/a b%2F?#"])
        assert [r.gateway_id for r in navigation.registry.gateways(0)] == [odd.self_id]
    assert navigation.registry.gateways(0) == []


async def test_the_own_zone_comes_first(navigation: NavigationServer) -> None:
    east = directory(navigation.url, "e", zone="east", kafka=1)
    west = directory(navigation.url, "w-busier", zone="west", kafka=2)
    async with started(east, west):
        await until(lambda: ids(west, "kafka") == ["w-busier", "e"])
        await until(lambda: ids(east, "kafka") == ["e", "w-busier"])


async def test_without_navigation_a_gateway_lists_itself_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    alone = directory(f"http://127.0.0.1:{port}", "g-alone", kafka=9001)
    # Before start too: a handler may ask while the gateway is starting.
    assert ids(alone, "kafka") == ["g-alone"]
    with caplog.at_level(logging.WARNING, logger="polymq.navigation.directory"):
        async with started(alone):
            assert not alone.reachable
            [own] = alone.endpoints("kafka")
            assert (own.host, own.port, own.zone, own.load) == ("127.0.0.1", 9001, "z", 7.0)
            assert alone.endpoints("amqp") == ()
            await asyncio.sleep(5 * BEAT_MS / 1000)  # several failed beats...
    warnings = [r for r in caplog.records if "listing this gateway alone" in r.getMessage()]
    assert len(warnings) == 1  # ...logged once


async def test_navigation_going_away_and_coming_back() -> None:
    first = NavigationServer(gateway_expiry_ms=EXPIRY_MS)
    await first.start()
    port = first.address[1]
    url = first.url
    one = directory(url, "g-one", kafka=9001)
    two = directory(url, "g-two", kafka=9002)
    async with started(one, two):
        await until(lambda: ids(one, "kafka") == ["g-one", "g-two"])
        await first.close()
        await until(lambda: not one.reachable)
        assert ids(one, "kafka") == ["g-one"]
        # A restarted navigation knows nobody; the next beats register both again.
        async with NavigationServer(port=port, gateway_expiry_ms=EXPIRY_MS):
            await until(lambda: ids(one, "kafka") == ["g-one", "g-two"])
            await until(lambda: ids(two, "kafka") == ["g-one", "g-two"])


async def _listening(port: int = 0) -> asyncio.Server:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    return await asyncio.start_server(drop, "127.0.0.1", port)


async def test_a_peer_that_refuses_connections_drops_out_before_the_expiry(
    navigation: NavigationServer,
) -> None:
    """A SIGKILLed gateway stops heartbeating, but navigation offers it until the
    expiry; its peers, dialling it, are refused at once and stop offering it, and
    offer it again once it listens again (restarted on its ports)."""
    mine, theirs = await _listening(), await _listening()
    own_port = mine.sockets[0].getsockname()[1]
    port = theirs.sockets[0].getsockname()[1]
    one = directory(navigation.url, "g-one", probe=True, kafka=own_port)
    two = directory(navigation.url, "g-two", probe=True, kafka=port)
    try:
        async with started(one, two):
            await until(lambda: ids(one, "kafka") == ["g-one", "g-two"])
            theirs.close()
            await theirs.wait_closed()
            await until(lambda: ids(one, "kafka") == ["g-one"])
            # Navigation itself still offers it (g-two goes on heartbeating here;
            # a killed one would be within its expiry).
            listed = navigation.registry.endpoints("kafka", SystemClock().now_ms())
            assert [e.gateway_id for e in listed] == ["g-one", "g-two"]
            assert ids(two, "kafka") == ["g-one", "g-two"]  # it never dials itself
            theirs = await _listening(port)
            await until(lambda: ids(one, "kafka") == ["g-one", "g-two"])
    finally:
        for server in (mine, theirs):
            server.close()
            await server.wait_closed()


def test_one_listener_per_peer_is_dialled() -> None:
    def ep(gateway_id: str, port: int, host: str = "h") -> GatewayEndpoint:
        return GatewayEndpoint(gateway_id=gateway_id, host=host, port=port)

    lists = {
        "mqtt_ws": (ep("a", 1), ep("b", 2), ep("c", 3)),
        "amqp": (ep("a", 4), ep("b", 5)),
        "kafka": (ep("me", 6), ep("a", 7), ep("d", 8, host="")),
    }
    # kafka first, then amqp, then the rest; never this gateway, never an empty host
    assert probe_targets(lists, "me") == {"a": ("h", 7), "b": ("h", 5), "c": ("h", 3)}


async def test_a_fresh_look_drops_a_refusing_peer_before_the_next_refresh(
    navigation: NavigationServer,
) -> None:
    """``check_peers``: what a Kafka Metadata request asks for, since a client asks
    it right after losing a gateway (the refresh here is a minute away)."""
    mine, theirs = await _listening(), await _listening()
    ports = [s.sockets[0].getsockname()[1] for s in (mine, theirs)]
    one, two = (
        NavigationDirectory(
            navigation.url,
            gateway_id=gateway_id,
            zone="z",
            endpoints=listeners(gateway_id, kafka=port),
            heartbeat_ms=60_000,
        )
        for gateway_id, port in zip(("g-one", "g-two"), ports, strict=True)
    )
    try:
        async with started(two, one):  # one registers last: it saw two at start
            assert ids(one, "kafka") == ["g-one", "g-two"]
            theirs.close()
            await theirs.wait_closed()
            await one.check_peers(max_age_s=60.0, timeout_s=1.0)  # the start's look is fresh
            assert ids(one, "kafka") == ["g-one", "g-two"]
            await one.check_peers(max_age_s=0.0, timeout_s=1.0)
            assert ids(one, "kafka") == ["g-one"]
            await asyncio.gather(  # several callers at once (they share one round)
                *(one.check_peers(max_age_s=0.0, timeout_s=1.0) for _ in range(5))
            )
            assert ids(one, "kafka") == ["g-one"]
            theirs = await _listening(ports[1])
            await one.check_peers(max_age_s=0.0, timeout_s=1.0)
            assert ids(one, "kafka") == ["g-one", "g-two"]
    finally:
        for server in (mine, theirs):
            server.close()
            await server.wait_closed()
