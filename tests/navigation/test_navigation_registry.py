"""Navigation's soft state, driven with plain numbers for time."""

from __future__ import annotations

import pytest

from polymq.navigation.registry import GatewayRegistry, Listener

T0 = 1_700_000_000_000
EXPIRY = 10_000


def kafka(port: int, host: str = "127.0.0.1") -> Listener:
    return Listener(protocol="kafka", host=host, port=port)


def amqp(port: int) -> Listener:
    return Listener(protocol="amqp", host="127.0.0.1", port=port)


def ids(registry: GatewayRegistry, protocol: str, now: int, zone: str = "") -> list[str]:
    return [e.gateway_id for e in registry.endpoints(protocol, now, zone=zone)]


def test_endpoints_of_one_protocol_least_loaded_first() -> None:
    registry = GatewayRegistry(gateway_expiry_ms=EXPIRY)
    registry.heartbeat(gateway_id="g1", zone="z", load=5, listeners=[kafka(1), amqp(2)], now_ms=T0)
    registry.heartbeat(gateway_id="g2", zone="z", load=1, listeners=[kafka(3)], now_ms=T0)
    registry.heartbeat(gateway_id="g3", zone="z", load=3, listeners=[amqp(4)], now_ms=T0)
    found = registry.endpoints("kafka", T0)
    assert [(e.gateway_id, e.port, e.load, e.zone) for e in found] == [
        ("g2", 3, 1, "z"),
        ("g1", 1, 5, "z"),
    ]
    assert ids(registry, "amqp", T0) == ["g3", "g1"]
    assert registry.endpoints("mqtt", T0) == []


def test_the_callers_zone_comes_first() -> None:
    registry = GatewayRegistry(gateway_expiry_ms=EXPIRY)
    registry.heartbeat(gateway_id="a", zone="east", load=0, listeners=[kafka(1)], now_ms=T0)
    registry.heartbeat(gateway_id="b", zone="west", load=9, listeners=[kafka(2)], now_ms=T0)
    registry.heartbeat(gateway_id="c", zone="west", load=4, listeners=[kafka(3)], now_ms=T0)
    assert ids(registry, "kafka", T0, zone="west") == ["c", "b", "a"]
    assert ids(registry, "kafka", T0, zone="east") == ["a", "c", "b"]
    assert ids(registry, "kafka", T0) == ["a", "c", "b"]  # no zone: by load alone
    assert ids(registry, "kafka", T0, zone="north") == ["a", "c", "b"]


def test_equal_loads_are_ordered_by_id_for_everyone() -> None:
    registry = GatewayRegistry(gateway_expiry_ms=EXPIRY)
    for gateway_id in ("m", "b", "x"):
        registry.heartbeat(
            gateway_id=gateway_id, zone="", load=1, listeners=[kafka(len(gateway_id))], now_ms=T0
        )
    assert ids(registry, "kafka", T0) == ["b", "m", "x"]


def test_silent_gateways_drop_out_and_are_forgotten_later() -> None:
    registry = GatewayRegistry(gateway_expiry_ms=EXPIRY)
    registry.heartbeat(gateway_id="a", zone="", load=0, listeners=[kafka(1)], now_ms=T0)
    registry.heartbeat(gateway_id="b", zone="", load=0, listeners=[kafka(2)], now_ms=T0 + 5000)
    assert ids(registry, "kafka", T0 + EXPIRY) == ["a", "b"]  # exactly the expiry: healthy
    assert ids(registry, "kafka", T0 + EXPIRY + 1) == ["b"]
    listed = registry.gateways(T0 + EXPIRY + 1)
    now = T0 + EXPIRY + 1
    assert [(r.gateway_id, r.healthy(now, EXPIRY)) for r in listed] == [("a", False), ("b", True)]
    # A heartbeat brings it back.
    registry.heartbeat(gateway_id="a", zone="", load=0, listeners=[kafka(1)], now_ms=now)
    assert ids(registry, "kafka", now) == ["a", "b"]
    # Long silent: forgotten.
    assert [r.gateway_id for r in registry.gateways(now + 31 * EXPIRY)] == []


def test_a_heartbeat_replaces_what_the_gateway_said_before() -> None:
    registry = GatewayRegistry(gateway_expiry_ms=EXPIRY)
    registry.heartbeat(gateway_id="a", zone="z", load=0, listeners=[kafka(1), amqp(2)], now_ms=T0)
    registry.heartbeat(gateway_id="a", zone="y", load=7, listeners=[kafka(9)], now_ms=T0 + 1)
    assert registry.endpoints("amqp", T0 + 1) == []
    [endpoint] = registry.endpoints("kafka", T0 + 1)
    assert (endpoint.port, endpoint.zone, endpoint.load) == (9, "y", 7)


def test_remove_is_immediate_and_idempotent() -> None:
    registry = GatewayRegistry(gateway_expiry_ms=EXPIRY)
    registry.heartbeat(gateway_id="a", zone="", load=0, listeners=[kafka(1)], now_ms=T0)
    assert registry.remove("a")
    assert not registry.remove("a")
    assert registry.endpoints("kafka", T0) == []
    assert registry.gateways(T0) == []


def test_expiry_must_be_positive() -> None:
    with pytest.raises(ValueError):
        GatewayRegistry(gateway_expiry_ms=0)
