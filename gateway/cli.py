"""The ``polymq`` command. ``polymq run`` (the default) starts the merged server; the
other subcommands are the separated form's processes, listed already so ``--help``
shows the whole shape, and honest about not being built yet."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from gateway.config import ENV_PREFIX, LISTENER_NAMES, ConfigError, GatewayConfig, load_config

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

# Subcommands of the separated form (DESIGN.md section 4): listed, not built yet.
_PLACEHOLDERS: Mapping[str, tuple[str, str]] = {
    "storage": ("run a storage node (separated form)", "issue 8"),
    "nameserver": ("run a nameserver: storage nodes register, routes are served", "issue 8"),
    "navigation": ("run the navigation service: where should a client connect", "issue 8"),
    "gateway": ("run a gateway over remote storage (--cluster NAMESERVER)", "issue 8"),
    "cluster": ("'cluster up': start storage, nameserver, navigation, gateway", "issue 8"),
    "conformance": ("run the cross-protocol conformance suite against --target", "issue 9"),
}

_LISTENER_LABELS: Mapping[str, str] = {
    "kafka": "Kafka",
    "amqp": "AMQP 0-9-1",
    "mqtt": "MQTT over TCP",
    "mqtt_ws": "MQTT over WebSocket",
    "rocketmq": "RocketMQ 5 gRPC",
    "http": "HTTP (MNS-style API, /metrics, admin)",
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

    run = commands.add_parser(
        "run",
        help="run the merged server in the foreground (the default)",
        description="Run gateway and embedded storage in one process, in the foreground. "
        "SIGINT or SIGTERM stops it cleanly (exit code 0).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help=f"TOML config file (default: ${ENV_PREFIX}CONFIG if set, else none)",
    )
    run.add_argument("--data-dir", type=Path, metavar="DIR", help="storage directory [./data]")
    run.add_argument(
        "--durability",
        choices=("sync", "async"),
        help="sync: fsync before acknowledging; async: fsync every flush interval [sync]",
    )
    run.add_argument("--host", metavar="ADDR", help="address every listener binds [127.0.0.1]")
    for name, listener in GatewayConfig().listeners.items():
        run.add_argument(
            f"--{name.replace('_', '-')}-port",
            type=int,
            metavar="PORT",
            dest=f"{name}_port",
            help=f"{_LISTENER_LABELS[name]} port, 0 for any free one [{listener.port}]",
        )
    run.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="logging level [info]"
    )

    for name, (summary, issue) in _PLACEHOLDERS.items():
        stub = commands.add_parser(
            name,
            help=f"{summary} [not built yet]",
            description=f"{summary}. Not built yet ({issue}).",
        )
        stub.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "storage.data_dir": args.data_dir,
        "storage.durability": args.durability,
        "server.host": args.host,
        "server.log_level": args.log_level,
    }
    for name in LISTENER_NAMES:
        overrides[f"listeners.{name}.port"] = getattr(args, f"{name}_port")
    return overrides


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "run")
    args = build_parser().parse_args(argv)

    if args.command in _PLACEHOLDERS:
        _, issue = _PLACEHOLDERS[args.command]
        print(f"polymq {args.command}: not built yet ({issue})", file=sys.stderr)
        return 2

    env_file = env.get(f"{ENV_PREFIX}CONFIG")
    path = args.config or (Path(env_file) if env_file else None)
    try:
        config = load_config(path, env, _overrides(args))
    except ConfigError as e:
        print(f"polymq: configuration error: {e}", file=sys.stderr)
        return 2

    from gateway.server import run  # the server pulls in the engine; --help need not

    return run(config)
