"""Gateway configuration: defaults < TOML file < environment < command-line flags.

Every layer is checked against the same dataclasses, so a typo in any of them is an
error naming the key and where it came from, never a silently ignored setting.
Environment variables are ``POLYMQ_`` plus the key path in capitals joined by double
underscores (``POLYMQ_STORAGE__DATA_DIR``, ``POLYMQ_LISTENERS__MQTT_WS__PORT``): a
single underscore stays part of a key name, so the mapping is unambiguous.
"""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin

from polymq.gateway.credentials import CredentialError, ScramKeys, check_password_hash
from polymq.gateway.permissions import RuleError, expand_operations
from polymq.nameserver.config import NameserverConfig
from polymq.navigation.config import NavigationConfig
from polymq.storage.model import DEFAULT_NAMESPACE
from polymq.storage.node_config import NodeConfig
from polymq.storage.replicated.config import ReplicationConfig

if TYPE_CHECKING:
    from polymq.storage.engine.config import EngineConfig

__all__ = [
    "ENV_PREFIX",
    "LISTENER_NAMES",
    "TLS_LISTENERS",
    "AccountConfig",
    "AmqpConfig",
    "AuthConfig",
    "AuthMode",
    "ClusterConfig",
    "ConfigError",
    "DurabilityMode",
    "GatewayConfig",
    "HttpConfig",
    "KafkaConfig",
    "LimitsConfig",
    "ListenerConfig",
    "ListenersConfig",
    "LogLevel",
    "MqttConfig",
    "NameserverConfig",
    "NavigationConfig",
    "NodeConfig",
    "PermissionConfig",
    "QuotaConfig",
    "QuotasConfig",
    "ReplicationConfig",
    "RocketMQConfig",
    "ServerConfig",
    "StorageConfig",
    "TlsConfig",
    "WorkersConfig",
    "engine_config",
    "load_config",
]

ENV_PREFIX = "POLYMQ_"
# Names the CLI reads itself (the file to load); they are not config keys.
_ENV_RESERVED = frozenset({"POLYMQ_CONFIG"})

AuthMode = Literal["open", "accounts"]
DurabilityMode = Literal["sync", "async"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]  # json: one object per line (gateway/log_format.py)

_T = TypeVar("_T")


class ConfigError(ValueError):
    """A setting is unknown, malformed or inconsistent; the message names it and its
    source so the user can fix it without reading code."""


# -- the settings --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"
    # Created at start-up (besides each account's), so clients find them.
    namespaces: tuple[str, ...] = (DEFAULT_NAMESPACE,)


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerConfig:
    enabled: bool = True
    port: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenersConfig:
    kafka: ListenerConfig = ListenerConfig(port=9092)
    amqp: ListenerConfig = ListenerConfig(port=5672)
    mqtt: ListenerConfig = ListenerConfig(port=1883)
    mqtt_ws: ListenerConfig = ListenerConfig(port=8083)
    rocketmq: ListenerConfig = ListenerConfig(port=8081)
    http: ListenerConfig = ListenerConfig(port=8080)
    # TLS beside each plaintext listener (docs/tls.md), served once [tls] names a
    # certificate: Kafka SSL/SASL_SSL, AMQPS, MQTTS, MQTT over WSS, gRPC over TLS, HTTPS.
    kafka_tls: ListenerConfig = ListenerConfig(port=9093)
    amqps: ListenerConfig = ListenerConfig(port=5671)
    mqtts: ListenerConfig = ListenerConfig(port=8883)
    mqtt_wss: ListenerConfig = ListenerConfig(port=8084)
    rocketmq_tls: ListenerConfig = ListenerConfig(port=8082)
    https: ListenerConfig = ListenerConfig(port=8443)

    def items(self) -> tuple[tuple[str, ListenerConfig], ...]:
        """Listeners in start-up order (the port table's order in docs/architecture.md)."""
        return tuple((name, getattr(self, name)) for name in LISTENER_NAMES)


LISTENER_NAMES: tuple[str, ...] = tuple(f.name for f in fields(ListenersConfig))
# Each TLS listener and the plaintext listener whose protocol it serves.
TLS_LISTENERS: Mapping[str, str] = types.MappingProxyType(
    {
        "kafka_tls": "kafka",
        "amqps": "amqp",
        "mqtts": "mqtt",
        "mqtt_wss": "mqtt_ws",
        "rocketmq_tls": "rocketmq",
        "https": "http",
    }
)

TlsVerify = Literal["none", "optional", "required"]
TlsVersion = Literal["1.2", "1.3"]
TlsPrincipal = Literal["none", "cn"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """TLS for the TLS listeners and between polymq processes (docs/tls.md). Ciphers
    are OpenSSL's defaults. SIGHUP reloads the files into the live listeners."""

    # PEM: the certificate chain (leaf first) and its private key. Unset: no TLS
    # listener is served.
    cert_file: Path | None = None
    key_file: Path | None = None
    # PEM bundle of the CAs whose client certificates are accepted (mutual TLS).
    ca_file: Path | None = None
    # Client certificates: not asked for, checked when sent, or required.
    verify: TlsVerify = "none"
    min_version: TlsVersion = "1.2"
    # "cn": a verified client certificate's subject CN names the account (AMQP
    # EXTERNAL, the MQTT user name, the Kafka SSL principal).
    principal_from: TlsPrincipal = "none"
    # Between polymq processes (storage RPC, nameserver, navigation): connect with TLS,
    # presenting cert_file, trusting ca_file; and serve them with TLS.
    internal: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    # Which storage the gateway uses (gateway.assembly): file:///path, memory:// or
    # polymq://host:port,… Empty: polymq:// over cluster.nameservers when they are
    # set, else the embedded engine over data_dir.
    url: str = ""
    data_dir: Path = Path("./data")
    durability: DurabilityMode = "sync"
    flush_interval_ms: int = 1000
    # A durable message is readable once written; its append's answer waits for the
    # fsync (docs/performance.md). False: readable only once fsynced.
    visible_before_fsync: bool = True
    segment_bytes: int = 128 << 20
    retention_ms: int = 7 * 24 * 3600 * 1000
    retention_bytes: int | None = None
    max_message_bytes: int = 16 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class PermissionConfig:
    """One permission rule of an account (docs/permissions.md): ``effect`` the
    ``operations`` (create, write, read, describe, delete, admin, or all) on the
    ``resource`` kind (topic, group, transactional_id) whose names ``match`` (literal,
    prefix or glob) ``pattern``, in ``namespace`` (the account's default if empty)."""

    resource: Literal["topic", "group", "transactional_id"]
    pattern: str
    operations: tuple[str, ...]
    match: Literal["literal", "prefix", "glob"] = "glob"
    effect: Literal["allow", "deny"] = "allow"
    namespace: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotaConfig:
    """An account's limits in one gateway process (docs/quotas.md); ``None``: no
    limit. Rates are per second, with one second's worth of burst."""

    produce_bytes_per_s: int | None = None
    consume_bytes_per_s: int | None = None
    requests_per_s: int | None = None
    connections: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class QuotasConfig:
    # For accounts without a quota of their own, and the anonymous principal of open
    # mode; empty (the default): no limits.
    default: QuotaConfig = QuotaConfig()


@dataclass(frozen=True, slots=True, kw_only=True)
class AccountConfig:
    """One tenant user. ``namespaces`` are those it may use; the first is its default
    unless ``default_namespace`` says otherwise. ``admin`` may use every namespace.
    ``permissions``: rules narrowing what it may do there; none keeps it all."""

    user: str
    # Credentials (docs/security.md): an argon2id PHC string and/or SCRAM keys in
    # RFC 5803 form, as `polymq passwd` prints them. ``password`` in clear is for
    # trials only (a warning says so at start-up).
    password: str | None = None
    password_hash: str | None = None
    scram_sha_256: str | None = None
    scram_sha_512: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    namespaces: tuple[str, ...] = (DEFAULT_NAMESPACE,)
    default_namespace: str | None = None
    admin: bool = False
    # Its own limits instead of [quotas] default (docs/quotas.md).
    quota: QuotaConfig | None = None
    permissions: tuple[PermissionConfig, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthConfig:
    mode: AuthMode = "open"
    accounts: tuple[AccountConfig, ...] = ()
    # Failed logins from one address (gateway.login_guard): this many in a row are
    # answered at once, then each waits twice the last, from the first delay up to
    # the max.
    login_failures_free: int = 2
    login_failure_delay_ms: int = 100
    login_failure_max_delay_ms: int = 3000


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsConfig:
    """What any one peer may take of the server, so that nothing it sends can stop,
    hang or bloat the process for everybody else (docs/limits.md)."""

    # Open connections: in all, per protocol (so idle sockets of one protocol cannot
    # lock the others out) and per source address.
    max_connections: int = 10_000
    max_connections_per_protocol: int = 5_000
    max_connections_per_address: int = 1_000
    # A connection must finish its protocol's handshake and login within this
    # (RabbitMQ's handshake_timeout), and a frame it has begun must arrive whole
    # within frame_timeout_ms, or it is closed: slow sockets hold nothing for long.
    handshake_timeout_ms: int = 10_000
    frame_timeout_ms: int = 60_000
    max_frame_bytes: int = 32 << 20
    # Until a connection has logged in, its frames may be at most this large (Kafka's
    # sasl.server.max.receive.size): an anonymous peer holds at most this much.
    max_unauthenticated_frame_bytes: int = 512 << 10
    # Memory held by frames still being read, all connections together (Kafka's
    # queued.max.request.bytes): past it, reading waits until frames are handled.
    max_buffered_frame_bytes: int = 256 << 20
    # Nesting of AMQP field tables and arrays, JSON and XML bodies, SQL92 filters.
    max_nesting_depth: int = 64
    # Items one request may carry (messages of a batch send, partitions of a
    # produce, entries of an MNS batch); larger ones get the protocol's error.
    max_batch_items: int = 10_000


# -- per-protocol settings: only what an operator of the anchor broker would tune ----


@dataclass(frozen=True, slots=True, kw_only=True)
class KafkaConfig:
    # Kafka's auto.create.topics.enable / num.partitions.
    auto_create_topics: bool = True
    default_partitions: int = 1
    # group.initial.rebalance.delay.ms: the first rebalance of an empty group waits
    # this long for more members. Kafka ships 3000; 0 lets a lone consumer start at once.
    group_initial_rebalance_delay_ms: int = 0
    # connections.max.idle.ms: an established connection with no request for this
    # long is closed, so an idle socket holds a connection slot for at most this.
    connections_max_idle_ms: int = 600_000


@dataclass(frozen=True, slots=True, kw_only=True)
class AmqpConfig:
    # What Connection.Tune proposes (RabbitMQ's defaults).
    heartbeat_s: int = 60
    frame_max: int = 131072
    channel_max: int = 2047
    # An exchange T is the storage topic T (docs/interop.md, natural names): its
    # publishes reach the other protocols' consumers of T, and what they store in T
    # reaches its bound queues. Off, or excluded by name (shell patterns, matched
    # against exchange names and amq.topic's first routing-key words), it costs
    # nothing; x-polymq-topic still links an exchange explicitly.
    natural_topics: bool = True
    natural_topics_exclude: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class MqttConfig:
    max_packet_bytes: int = 1 << 20
    receive_maximum: int = 32
    topic_alias_maximum: int = 65535
    # Sessions with no expiry given by a v5 client (and v3 persistent sessions) last
    # this long after disconnect; EMQX's session_expiry_interval default is 2 h.
    default_session_expiry_s: int = 7200
    # Mosquitto's max_keepalive: longer (or no) keep-alives asked by v5 clients are
    # capped to this in CONNACK (Server Keep Alive); 0 lets clients choose.
    max_keep_alive_s: int = 65535
    # EMQX's max_topic_levels: deeper topic names and filters are refused.
    max_topic_levels: int = 128
    # Topic filters one SUBSCRIBE or UNSUBSCRIBE may carry.
    max_filters_per_subscribe: int = 1_000
    # Mosquitto's sys_interval: how often $SYS subscribers get fresh values.
    sys_interval_s: int = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class RocketMQConfig:
    # RocketMQ's autoCreateTopicEnable / autoCreateSubscriptionGroup.
    auto_create: bool = True
    # RocketMQ's flushDiskType: "async" (ASYNC_FLUSH, Apache's default) answers a send
    # once written, fsynced within storage.flush_interval_ms; "sync" once fsynced.
    flush: DurabilityMode = "async"


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpConfig:
    # MNS's 64 KiB message limit and the signature's allowed clock skew.
    max_message_bytes: int = 64 << 10
    max_date_skew_s: int = 900


# -- the separated form (docs/architecture.md, docs/cluster.md) -------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """A gateway in Cluster mode, and a storage node: where the nameservers and the
    navigation service are. Empty ``nameservers`` is the merged form."""

    nameservers: tuple[str, ...] = ()  # "host:port" each; nodes report to all of them
    navigation: str = ""  # base URL, e.g. http://127.0.0.1:8090
    zone: str = "default"  # the network/zone a gateway registers under
    gateway_id: str = ""  # empty: host and port of the first listener
    advertised_host: str = ""  # what clients are told to dial; empty: server.host
    heartbeat_ms: int = 1000  # storage nodes to nameservers, gateways to navigation
    # How long a starting gateway waits for a first live storage node before it serves
    # without one (storage calls answer "unavailable" until a node registers).
    storage_wait_ms: int = 30_000


# -- several gateway processes on one machine (docs/workers.md) ------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkersConfig:
    """``polymq run --workers N``: N gateway processes sharing the listening ports
    (``SO_REUSEPORT``) over one engine served by the parent process. ``worker`` and
    the two ports after it are what the parent tells each worker; a user sets only
    ``count`` and ``kafka_ports_from``."""

    count: int = 1  # gateway processes; 1: today's single process, no extra hop
    # Each worker's own Kafka port (Metadata names every worker as a broker there):
    # worker i gets kafka_ports_from + i - 1 (and the TLS one kafka_ports_from + 100
    # + i - 1); 0: free ports picked once at start-up, kept across worker restarts.
    kafka_ports_from: int = 0
    worker: int = 0  # which worker this process is (1…count); 0: not a worker
    kafka_port: int = 0  # this worker's own Kafka port (set by the parent)
    kafka_tls_port: int = 0  # this worker's own Kafka TLS port (set by the parent)

    @property
    def reuse_port(self) -> bool:
        """Whether listeners bind their ports shared with the other workers."""
        return self.worker > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    listeners: ListenersConfig = field(default_factory=ListenersConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    quotas: QuotasConfig = field(default_factory=QuotasConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    amqp: AmqpConfig = field(default_factory=AmqpConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    rocketmq: RocketMQConfig = field(default_factory=RocketMQConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    nameserver: NameserverConfig = field(default_factory=NameserverConfig)
    navigation: NavigationConfig = field(default_factory=NavigationConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)


# -- loading -------------------------------------------------------------------------


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Merge the layers, later ones winning key by key, and validate the result.

    ``env`` is passed in (not read from ``os.environ``) so tests and embedders decide
    what the process sees. ``overrides`` maps dotted key paths
    (``"listeners.kafka.port"``) to values, as the CLI's flags produce them; ``None``
    values are skipped so an unset flag does not mask lower layers.
    """
    env = env or {}
    config = GatewayConfig()
    if path is not None:
        config = _apply(config, _read_toml(path), source=f"config file {path}", text=False)
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in _ENV_RESERVED:
            continue
        keys = name[len(ENV_PREFIX) :].lower().split("__")
        if not all(keys):
            raise ConfigError(
                f"environment variable {name}: expected {ENV_PREFIX}SECTION__KEY "
                "(double underscores between the parts)"
            )
        raw = _nest(keys, env[name])
        config = _apply(config, raw, source=f"environment variable {name}", text=True)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        raw = _nest(dotted.split("."), value)
        config = _apply(config, raw, source=f"override {dotted!r}", text=True)
    _validate(config)
    return config


def engine_config(config: GatewayConfig) -> EngineConfig:
    """The embedded engine's settings from the gateway's. Imported here, not at module
    top, so the gateway's config loads without the storage engine."""
    from polymq.storage.engine.config import Durability, EngineConfig

    s = config.storage
    return EngineConfig(
        data_dir=s.data_dir,
        durability=Durability(s.durability),
        flush_interval_ms=s.flush_interval_ms,
        visible_before_fsync=s.visible_before_fsync,
        segment_bytes=s.segment_bytes,
        retention_ms=s.retention_ms,
        retention_bytes=s.retention_bytes,
        max_message_bytes=s.max_message_bytes,
    )


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: not valid TOML: {e}") from e


def _nest(keys: list[str], value: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {keys[-1]: value}
    for key in reversed(keys[:-1]):
        raw = {key: raw}
    return raw


def _apply(obj: _T, raw: Mapping[str, Any], *, source: str, text: bool, prefix: str = "") -> _T:
    """``obj`` with the keys of ``raw`` replaced, recursing into sections.

    ``text`` says values are strings to parse (environment, flags); TOML values must
    already have the right type, since TOML has types and a quoted port is a mistake.
    """
    hints = typing.get_type_hints(type(obj))
    changes: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {where!r}{_suggest(key, hints)}")
        tp = hints[key]
        if is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: {where!r} is a section; give it keys, not a value")
            changes[key] = _apply(
                getattr(obj, key), value, source=source, text=text, prefix=f"{where}."
            )
        else:
            changes[key] = _coerce(value, tp, where=where, source=source, text=text)
    return replace(obj, **changes) if changes else obj  # type: ignore[type-var]


def _suggest(key: str, hints: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(hints), n=1)
    known = ", ".join(sorted(hints))
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {known})"


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _coerce(value: Any, tp: Any, *, where: str, source: str, text: bool) -> Any:
    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{source}: {where!r} must be {expected}, got {value!r}")

    origin = get_origin(tp)
    parse = text and isinstance(value, str)
    if origin is Literal:
        choices = get_args(tp)
        candidate = value.strip().lower() if parse else value
        if candidate in choices:
            return candidate
        raise fail("one of " + ", ".join(repr(c) for c in choices))
    if origin in (Union, types.UnionType):
        (inner,) = (a for a in get_args(tp) if a is not type(None))
        if parse and value.strip().lower() in ("", "none", "null"):
            return None
        return _coerce(value, inner, where=where, source=source, text=text)
    if is_dataclass(tp):  # a table inside an array entry (an account's quota)
        if parse:
            raise ConfigError(f"{source}: {where!r} can only be set in the config file")
        return _build(tp, value, where=where, source=source)
    if origin is tuple:
        (item,) = get_args(tp)[:1]
        if is_dataclass(item):
            if parse:
                raise ConfigError(f"{source}: {where!r} can only be set in the config file")
            if not isinstance(value, list):
                raise fail("an array of tables")
            return tuple(
                _build(item, entry, where=f"{where}[{i}]", source=source)
                for i, entry in enumerate(value)
            )
        if parse:
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list | tuple):
            raise fail("a list")
        return tuple(
            _coerce(v, item, where=f"{where}[{i}]", source=source, text=text)
            for i, v in enumerate(value)
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        if parse and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise fail("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if parse:
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise fail("an integer")
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail("a string")
    if tp is Path:
        if isinstance(value, str | Path) and str(value):
            return Path(value)
        raise fail("a path")
    raise TypeError(f"config type {tp!r} of {where!r} has no parser")  # our bug


def _build(cls: Any, raw: Any, *, where: str, source: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: {where!r} must be a table")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {f'{where}.{key}'!r}{_suggest(key, hints)}")
        kwargs[key] = _coerce(value, hints[key], where=f"{where}.{key}", source=source, text=False)
    required = [f.name for f in fields(cls) if f.default is f.default_factory is MISSING]
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise ConfigError(f"{source}: {where!r} lacks required key {missing[0]!r}")
    return cls(**kwargs)


# -- consistency ---------------------------------------------------------------------


def _validate(config: GatewayConfig) -> None:
    """Checks that span keys or ranges no type expresses; run on the merged result so
    a later layer can repair an earlier one."""

    def positive(where: str, value: int | None) -> None:
        if value is not None and value <= 0:
            raise ConfigError(f"{where!r} must be positive, got {value}")

    used: dict[int, str] = {}
    for name, listener in config.listeners.items():
        if not 0 <= listener.port <= 65535:
            raise ConfigError(f"'listeners.{name}.port' must be 0..65535, got {listener.port}")
        if listener.enabled and listener.port:
            if listener.port in used:
                raise ConfigError(
                    f"listeners {used[listener.port]!r} and {name!r} both use port {listener.port}"
                )
            used[listener.port] = name

    s = config.storage
    for key in ("flush_interval_ms", "segment_bytes", "retention_ms", "max_message_bytes"):
        positive(f"storage.{key}", getattr(s, key))
    positive("storage.retention_bytes", s.retention_bytes)
    for f in fields(LimitsConfig):
        positive(f"limits.{f.name}", getattr(config.limits, f.name))
    positive("kafka.connections_max_idle_ms", config.kafka.connections_max_idle_ms)
    positive("mqtt.max_topic_levels", config.mqtt.max_topic_levels)
    positive("mqtt.max_filters_per_subscribe", config.mqtt.max_filters_per_subscribe)
    positive("cluster.heartbeat_ms", config.cluster.heartbeat_ms)
    positive("nameserver.node_expiry_ms", config.nameserver.node_expiry_ms)
    positive("navigation.gateway_expiry_ms", config.navigation.gateway_expiry_ms)
    positive("workers.count", config.workers.count)
    for where, port in (
        ("node.port", config.node.port),
        ("nameserver.port", config.nameserver.port),
        ("navigation.port", config.navigation.port),
        ("workers.kafka_ports_from", config.workers.kafka_ports_from),
    ):
        if not 0 <= port <= 65535:
            raise ConfigError(f"{where!r} must be 0..65535, got {port}")
    for i, address in enumerate(config.cluster.nameservers):
        host, _, port_text = address.rpartition(":")
        if not host or not port_text.isdigit():
            raise ConfigError(f"'cluster.nameservers[{i}]' must be host:port, got {address!r}")

    for i, ns in enumerate(config.server.namespaces):
        if not ns:
            raise ConfigError(f"'server.namespaces[{i}]' must not be empty")

    _validate_accounts(config.auth)
    quotas = [("quotas.default", config.quotas.default)]
    quotas += [
        (f"auth.accounts[{i}].quota", a.quota)
        for i, a in enumerate(config.auth.accounts)
        if a.quota is not None
    ]
    for where, quota in quotas:
        for f in fields(QuotaConfig):
            positive(f"{where}.{f.name}", getattr(quota, f.name))
    _validate_tls(config.tls)


def _validate_tls(tls: TlsConfig) -> None:
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError("'tls.cert_file' and 'tls.key_file' go together")
    if tls.verify != "none" and tls.ca_file is None:
        raise ConfigError(f"'tls.verify' is {tls.verify!r} but no 'tls.ca_file' names the CAs")
    if tls.principal_from != "none" and tls.verify == "none":
        raise ConfigError("'tls.principal_from' needs client certificates: set 'tls.verify'")
    if tls.internal and (tls.cert_file is None or tls.ca_file is None):
        raise ConfigError("'tls.internal' needs 'tls.cert_file', 'tls.key_file' and 'tls.ca_file'")


def _validate_accounts(auth: AuthConfig) -> None:
    for key in ("login_failures_free", "login_failure_delay_ms", "login_failure_max_delay_ms"):
        if getattr(auth, key) < 0:
            raise ConfigError(f"'auth.{key}' must not be negative, got {getattr(auth, key)}")
    if auth.mode == "accounts" and not auth.accounts:
        raise ConfigError(
            "'auth.mode' is 'accounts' but no [[auth.accounts]] are configured: "
            "nobody could connect"
        )
    users: set[str] = set()
    keys: set[str] = set()
    for i, account in enumerate(auth.accounts):
        where = f"auth.accounts[{i}]"
        if not account.user:
            raise ConfigError(f"{where!r}: 'user' must not be empty")
        if account.user in users:
            raise ConfigError(f"{where!r}: user {account.user!r} is configured twice")
        users.add(account.user)
        if (account.access_key is None) != (account.secret_key is None):
            raise ConfigError(f"{where!r}: 'access_key' and 'secret_key' go together")
        _validate_credentials(where, account)
        if account.access_key is not None:
            if account.access_key in keys:
                raise ConfigError(f"{where!r}: access key {account.access_key!r} is used twice")
            keys.add(account.access_key)
        if not account.namespaces and not account.admin:
            raise ConfigError(f"{where!r}: 'namespaces' is empty (and the user is no admin)")
        if any(not ns for ns in account.namespaces):
            raise ConfigError(f"{where!r}: a namespace name is empty")
        default = account.default_namespace
        if default is not None and default not in account.namespaces and not account.admin:
            raise ConfigError(
                f"{where!r}: 'default_namespace' {default!r} is not in its 'namespaces'"
            )
        for j, rule in enumerate(account.permissions):
            try:
                expand_operations(rule.operations)
            except RuleError as e:
                raise ConfigError(f"'{where}.permissions[{j}]': {e}") from None
            if not rule.pattern and rule.match != "prefix":
                raise ConfigError(f"'{where}.permissions[{j}]': 'pattern' is empty")


def _validate_credentials(where: str, account: AccountConfig) -> None:
    """Stored credentials parse now, so a typo is a start-up error, not a login that
    fails later; the messages never echo a secret."""
    if account.password is not None and account.password_hash is not None:
        raise ConfigError(f"{where!r}: give 'password_hash' or (for trials) 'password', not both")
    logins = (account.password, account.password_hash, account.scram_sha_256, account.scram_sha_512)
    if all(c is None for c in logins) and account.access_key is None:
        raise ConfigError(
            f"{where!r}: user {account.user!r} has neither a password nor an access key"
            " (give password_hash and/or scram_sha_256/512: `polymq passwd` prints them)"
        )
    checks: tuple[tuple[str, str | None, Callable[[str], object]], ...] = (
        ("password_hash", account.password_hash, check_password_hash),
        ("scram_sha_256", account.scram_sha_256, lambda t: ScramKeys.parse("SCRAM-SHA-256", t)),
        ("scram_sha_512", account.scram_sha_512, lambda t: ScramKeys.parse("SCRAM-SHA-512", t)),
    )
    for key, text, check in checks:
        if text is None:
            continue
        try:
            check(text)
        except CredentialError as e:
            raise ConfigError(f"{where!r}: {key!r} of user {account.user!r}: {e}") from None
