from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from polymq.gateway.cli import _overrides, build_parser
from polymq.gateway.config import (
    AccountConfig,
    ConfigError,
    GatewayConfig,
    engine_config,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "polymq.example.toml"
DOCS = ROOT / "docs" / "configuration.md"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "polymq.toml"
    path.write_text(text)
    return path


def flags(*argv: str) -> dict[str, Any]:
    return _overrides(build_parser().parse_args(["run", *argv]))


def test_defaults() -> None:
    config = load_config(None, {}, {})
    assert config == GatewayConfig()
    assert config.server.host == "127.0.0.1"
    assert config.storage.data_dir == Path("./data")
    assert config.storage.durability == "sync"
    assert config.auth.mode == "open"
    ports = {name: listener.port for name, listener in config.listeners.items()}
    assert ports == {
        "kafka": 9092,
        "amqp": 5672,
        "mqtt": 1883,
        "mqtt_ws": 8083,
        "rocketmq": 8081,
        "http": 8080,
        "kafka_tls": 9093,
        "amqps": 5671,
        "mqtts": 8883,
        "mqtt_wss": 8084,
        "rocketmq_tls": 8082,
        "https": 8443,
    }


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [storage]
        data_dir = "/from/file"
        durability = "async"
        [listeners.kafka]
        port = 1001
        [listeners.amqp]
        port = 2001
        """,
    )
    env = {"POLYMQ_STORAGE__DATA_DIR": "/from/env", "POLYMQ_LISTENERS__KAFKA__PORT": "1002"}

    from_file = load_config(path, {}, {})
    assert from_file.storage.data_dir == Path("/from/file")
    assert from_file.storage.durability == "async"
    assert from_file.listeners.kafka.port == 1001
    assert from_file.storage.segment_bytes == GatewayConfig().storage.segment_bytes

    from_env = load_config(path, env, {})
    assert from_env.storage.data_dir == Path("/from/env")
    assert from_env.listeners.kafka.port == 1002
    assert from_env.listeners.amqp.port == 2001  # the file still counts where env is silent
    assert from_env.storage.durability == "async"

    from_flags = load_config(path, env, flags("--data-dir", "/from/flags", "--kafka-port", "0"))
    assert from_flags.storage.data_dir == Path("/from/flags")
    assert from_flags.listeners.kafka.port == 0
    assert from_flags.listeners.amqp.port == 2001
    assert from_flags.storage.durability == "async"  # no --durability: lower layers win


def test_every_run_flag_reaches_its_key() -> None:
    config = load_config(
        None,
        {},
        flags(
            "--data-dir=/d",
            "--durability=async",
            "--host=0.0.0.0",
            "--log-level=debug",
            "--kafka-port=1",
            "--amqp-port=2",
            "--mqtt-port=3",
            "--mqtt-ws-port=4",
            "--rocketmq-port=5",
            "--http-port=6",
            "--kafka-tls-port=7",
            "--amqps-port=8",
            "--mqtts-port=9",
            "--mqtt-wss-port=10",
            "--rocketmq-tls-port=11",
            "--https-port=12",
        ),
    )
    assert config.storage.data_dir == Path("/d")
    assert config.storage.durability == "async"
    assert config.server.host == "0.0.0.0"
    assert config.server.log_level == "debug"
    ports = [listener.port for _, listener in config.listeners.items()]
    assert ports == list(range(1, 13))


def test_env_parses_text_values() -> None:
    config = load_config(
        None,
        {
            "POLYMQ_LISTENERS__MQTT_WS__ENABLED": "off",
            "POLYMQ_STORAGE__RETENTION_BYTES": "1_000_000",
            "POLYMQ_SERVER__NAMESPACES": "default, team-a",
            "POLYMQ_AUTH__MODE": "OPEN",
            "POLYMQ_CONFIG": "/ignored/here",
            "HOME": "/unrelated",
        },
        {},
    )
    assert config.listeners.mqtt_ws.enabled is False
    assert config.storage.retention_bytes == 1_000_000
    assert config.server.namespaces == ("default", "team-a")
    assert config.auth.mode == "open"

    unset = load_config(
        None, {"POLYMQ_STORAGE__RETENTION_BYTES": "none"}, {"storage.retention_bytes": "5"}
    )
    assert unset.storage.retention_bytes == 5


def test_unknown_key_in_file_names_it(tmp_path: Path) -> None:
    path = write(tmp_path, "[storage]\ndat_dir = '/x'\n")
    with pytest.raises(ConfigError, match=r"storage\.dat_dir") as info:
        load_config(path, {}, {})
    assert str(path) in str(info.value)
    assert "did you mean 'data_dir'" in str(info.value)


def test_unknown_section_in_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'stroage'"):
        load_config(write(tmp_path, "[stroage]\ndata_dir = '/x'\n"), {}, {})


def test_unknown_environment_variable_names_it() -> None:
    with pytest.raises(ConfigError, match="POLYMQ_LISTENERS__KAFKA__PROT"):
        load_config(None, {"POLYMQ_LISTENERS__KAFKA__PROT": "1"}, {})


def test_single_underscore_is_not_a_separator() -> None:
    with pytest.raises(ConfigError, match="unknown key 'storage_data_dir'"):
        load_config(None, {"POLYMQ_STORAGE_DATA_DIR": "/x"}, {})


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ("[listeners.kafka]\nport = '9092'", r"'listeners\.kafka\.port' must be an integer"),
        ("[listeners.kafka]\nport = true", r"'listeners\.kafka\.port' must be an integer"),
        ("[listeners.kafka]\nport = 70000", r"must be 0\.\.65535"),
        ("[listeners.kafka]\nenabled = 'yes'", "must be true or false"),
        ("[storage]\ndurability = 'fast'", "must be one of 'sync', 'async'"),
        ("[storage]\nsegment_bytes = 0", "must be positive"),
        ("[storage]\nretention_bytes = -1", "must be positive"),
        ("[listeners]\nkafka = 9092", "is a section"),
        ("[listeners.amqp]\nport = 9092", "both use port 9092"),
        ("[auth]\nmode = 'accounts'", "no \\[\\[auth.accounts\\]\\]"),
        ("[auth]\nmode = 'secret'", "must be one of 'open', 'accounts'"),
        ("[server]\nnamespaces = 'default'", "must be a list"),
        ("storage = [", "not valid TOML"),
    ],
)
def test_bad_value_in_file(tmp_path: Path, toml: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, toml), {}, {})


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"POLYMQ_LISTENERS__KAFKA__PORT": "ninety"}, "must be an integer, got 'ninety'"),
        ({"POLYMQ_LISTENERS__KAFKA__ENABLED": "maybe"}, "must be true or false"),
        ({"POLYMQ_AUTH__ACCOUNTS": "alice"}, "only be set in the config file"),
        ({"POLYMQ_STORAGE____DATA_DIR": "/x"}, "double underscores"),
    ],
)
def test_bad_value_in_environment(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load_config(None, env, {})
    assert next(iter(env)) in str(info.value)


def test_disabled_listeners_may_share_a_port_and_port_zero_repeats() -> None:
    config = load_config(
        None,
        {"POLYMQ_LISTENERS__AMQP__PORT": "9092", "POLYMQ_LISTENERS__AMQP__ENABLED": "false"},
        flags("--mqtt-port=0", "--http-port=0"),
    )
    assert config.listeners.amqp.port == 9092


def test_a_later_layer_can_repair_an_earlier_one(tmp_path: Path) -> None:
    path = write(tmp_path, "[listeners.amqp]\nport = 9092\n")
    config = load_config(path, {"POLYMQ_LISTENERS__AMQP__PORT": "5673"}, {})
    assert config.listeners.amqp.port == 5673


def test_accounts_from_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [auth]
        mode = "accounts"
        [[auth.accounts]]
        user = "alice"
        password = "pw"
        namespaces = ["a", "shared"]
        [[auth.accounts]]
        user = "ops"
        access_key = "AK"
        secret_key = "SK"
        admin = true
        """,
    )
    config = load_config(path, {}, {})
    assert config.auth.accounts == (
        AccountConfig(user="alice", password="pw", namespaces=("a", "shared")),
        AccountConfig(user="ops", access_key="AK", secret_key="SK", admin=True),
    )


@pytest.mark.parametrize(
    ("account", "match"),
    [
        ("password = 'x'", "lacks required key 'user'"),
        ("user = 'a'\npasswd = 'x'", r"unknown key 'auth\.accounts\[0\]\.passwd'"),
        ("user = 'a'", "neither a password nor an access key"),
        ("user = 'a'\naccess_key = 'k'", "go together"),
        ("user = 'a'\npassword = 'x'\nnamespaces = []", "'namespaces' is empty"),
        ("user = 'a'\npassword = 'x'\ndefault_namespace = 'b'", "not in its 'namespaces'"),
    ],
)
def test_bad_account(tmp_path: Path, account: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, f"[[auth.accounts]]\n{account}\n"), {}, {})


def test_duplicate_users_and_access_keys(tmp_path: Path) -> None:
    twice = "[[auth.accounts]]\nuser = 'a'\npassword = 'x'\n" * 2
    with pytest.raises(ConfigError, match="configured twice"):
        load_config(write(tmp_path, twice), {}, {})
    keys = "".join(
        f"[[auth.accounts]]\nuser = '{u}'\naccess_key = 'K'\nsecret_key = 's'\n" for u in "ab"
    )
    with pytest.raises(ConfigError, match="used twice"):
        load_config(write(tmp_path, keys), {}, {})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config(tmp_path / "absent.toml", {}, {})


def _uncommented_example() -> str:
    # "# key = value" lines are the documented defaults; prose comments don't match.
    return re.sub(r"(?m)^# ([a-z_]+ = )", r"\1", EXAMPLE.read_text())


def test_example_file_loads_and_states_the_defaults(tmp_path: Path) -> None:
    assert load_config(EXAMPLE, {}, {}) == GatewayConfig()
    uncommented = write(tmp_path, _uncommented_example())
    assert load_config(uncommented, {}, {}) == GatewayConfig()


def _leaf_keys(cls: Any) -> set[str]:
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if dataclasses.is_dataclass(default):
            keys |= _leaf_keys(type(default))
        else:
            keys.add(f.name)
    return keys


def test_example_and_docs_mention_every_key() -> None:
    keys = _leaf_keys(GatewayConfig) | _leaf_keys(AccountConfig)
    example, docs = EXAMPLE.read_text(), DOCS.read_text()
    assert sorted(k for k in keys if k not in example) == []
    assert sorted(k for k in keys if f"`{k}`" not in docs) == []


def test_engine_config_carries_storage_settings() -> None:
    from polymq.storage.engine.config import Durability

    config = load_config(
        None,
        {"POLYMQ_STORAGE__DURABILITY": "async", "POLYMQ_STORAGE__RETENTION_BYTES": "7"},
        flags("--data-dir=/d"),
    )
    engine = engine_config(config)
    assert engine.data_dir == Path("/d")
    assert engine.durability is Durability.ASYNC
    assert engine.retention_bytes == 7
    assert engine.max_message_bytes == config.storage.max_message_bytes
    assert engine.segment_bytes == config.storage.segment_bytes
