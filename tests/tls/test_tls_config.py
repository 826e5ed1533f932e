"""[tls] settings: inconsistent ones are refused naming the key, unreadable files at
start-up, and without a certificate no TLS listener is built (the plaintext ones
serve as before)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polymq.gateway.assembly import protocol_listeners
from polymq.gateway.config import TLS_LISTENERS, ConfigError, engine_config, load_config
from polymq.gateway.gateway import Gateway
from polymq.gateway.tls import ServerTls, peer_common_name
from polymq.navigation.endpoints import GatewayEndpoint
from polymq.protocols.mqtt.peers import Peers
from polymq.storage.memory import MemoryEngine
from tests.tls.conftest import Certs

ONE_FORM = True  # no server


@pytest.mark.parametrize(
    "settings,complaint",
    [
        ({"tls.cert_file": "/c.pem"}, "go together"),
        ({"tls.verify": "required"}, "ca_file"),
        ({"tls.principal_from": "cn"}, "needs client certificates"),
        ({"tls.internal": "true", "tls.cert_file": "/c", "tls.key_file": "/k"}, "ca_file"),
        ({"tls.min_version": "1.1"}, "one of"),
    ],
)
def test_inconsistent_settings_are_refused(settings: dict[str, str], complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        load_config(overrides=settings)


def test_an_unreadable_key_is_a_config_error(certs: Certs, tmp_path: Path) -> None:
    config = load_config(
        overrides={"tls.cert_file": str(certs.server_chain), "tls.key_file": str(tmp_path / "no")}
    )
    with pytest.raises(ConfigError, match=r"\[tls\]"):
        ServerTls(config.tls)


def test_no_certificate_no_tls_listener(tmp_path: Path) -> None:
    config = load_config(overrides={"storage.data_dir": str(tmp_path)})
    gateway = Gateway(
        config, storage=MemoryEngine(engine_config(config)), listener_factories=protocol_listeners()
    )
    built = {listener.name for listener in gateway.listeners}
    assert built and not built & set(TLS_LISTENERS)
    assert not set(gateway.unbuilt) & set(TLS_LISTENERS)


def test_the_common_name_is_the_most_specific_one() -> None:
    subject = ((("organizationName", "clients"),), (("commonName", "alice"),))
    assert peer_common_name({"subject": subject}) == "alice"
    assert peer_common_name({}) is None


class _Directory:
    def __init__(self, lists: dict[str, list[GatewayEndpoint]]) -> None:
        self._lists = lists

    @property
    def self_id(self) -> str:
        return "a"

    def endpoints(self, protocol: str) -> list[GatewayEndpoint]:
        return self._lists.get(protocol, [])


def test_a_gateway_serving_mqtts_alone_is_an_mqtt_peer() -> None:
    def at(gateway: str, port: int) -> GatewayEndpoint:
        return GatewayEndpoint(gateway_id=gateway, host="127.0.0.1", port=port)

    directory = _Directory({"mqtt": [at("a", 1883)], "mqtts": [at("a", 8883), at("b", 8983)]})
    peers = Peers(self_id="a", directory=directory)
    assert peers.alive() == {"a", "b"}
    keys = [f"topic-{i}" for i in range(32)]
    assert 0 < sum(peers.owns(key) for key in keys) < len(keys)  # b owns some
