"""``polymq run --workers N``: every core of one machine, as N gateway processes
sharing the listening ports over one embedded engine.

Why this shape: a gateway is one Python process on one core, and most of a message's
CPU is spent in the gateway (protocol parsing, routing, delivery), not in the engine.
The separated form (docs/cluster.md) already runs several gateways over storage
nodes, and every piece of protocol state that lives in one gateway's memory (MQTT
sessions and takeover, AMQP exclusive queues and consumers, Kafka coordinators)
already works across gateways there. So ``--workers N`` is that form, packed into
one command on one machine:

- the **parent** opens the engine over ``storage.data_dir`` (the very data
  ``--workers 1`` serves, so one can switch back and forth) and serves it as a
  storage node over the storage RPC on loopback, beside an in-process nameserver
  (the node's route) and navigation service (the workers' directory);
- each **worker** is a gateway of the separated form (``polymq worker``) over that
  node, whose listeners bind the configured ports with ``SO_REUSEPORT``, so the
  kernel spreads the connections over the workers. Kafka clients must reach one
  broker for a group's coordinator or a partition's leader, which a shared port
  cannot promise, so each worker also listens on a Kafka port of its own
  (``workers.kafka_ports_from``) and advertises that one: a client bootstraps on the
  shared port and Metadata names every worker as a broker at its own port;
- a worker that dies is restarted on the same ports after the separated form's
  :class:`~gateway.cluster_tool.Backoff` (the :class:`Supervisor` of ``cluster
  up``); SIGINT/SIGTERM of the parent stops the workers, then the engine.

``--workers 1`` (the default) is none of this: today's single process, no hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from polymq.gateway.cluster_tool import LocalCluster, ProcessSpec, Supervisor
from polymq.gateway.config import ENV_PREFIX, TLS_LISTENERS, GatewayConfig, engine_config
from polymq.gateway.foreground import announce, run_foreground
from polymq.gateway.roles import register_batch_formats
from polymq.gateway.server import run
from polymq.nameserver.server import Nameserver
from polymq.navigation.server import NavigationServer
from polymq.storage.engine import Engine
from polymq.storage.node import StorageNode
from polymq.storage.replicated.local_nats import free_ports

__all__ = [
    "STATUS_FILE",
    "WorkerStartError",
    "listener_ports",
    "run_parent",
    "run_worker",
    "worker_config",
    "worker_specs",
]

log = logging.getLogger("polymq.workers")

STATUS_FILE = "workers-status.json"  # in storage.data_dir: pids, restarts, exits
_LOOPBACK = "127.0.0.1"  # the engine, nameserver and navigation serve the workers only
# Listeners one worker serves alone: MQTT over WebSocket binds through websockets'
# serve(), which takes no SO_REUSEPORT from here (protocols/mqtt/listener.py).
_FIRST_WORKER_ONLY = ("mqtt_ws", "mqtt_wss")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerStartError(OSError):
    """A worker did not start (a port taken, a bad setting): the server cannot start,
    which the foreground runner reports and exits 1 for, as for a port taken."""


def listener_ports(config: GatewayConfig) -> dict[str, int]:
    """The enabled listeners' ports, a port of 0 made a free one now: every worker
    must bind the same port, which the kernel would otherwise pick per worker."""
    enabled = {name: lst.port for name, lst in config.listeners.items() if lst.enabled}
    free = iter(free_ports(sum(1 for p in enabled.values() if p == 0), config.server.host))
    return {name: port or next(free) for name, port in enabled.items()}


def _kafka_ports(config: GatewayConfig) -> list[tuple[int, int]]:
    """Each worker's own Kafka port and Kafka TLS port."""
    count, first = config.workers.count, config.workers.kafka_ports_from
    if first:
        return [(first + i, first + 100 + i) for i in range(count)]
    ports = free_ports(2 * count, config.server.host)
    return [(ports[2 * i], ports[2 * i + 1]) for i in range(count)]


def worker_specs(
    config: GatewayConfig, config_path: Path | None, nameserver: str, navigation: str
) -> list[ProcessSpec]:
    """The ``polymq worker`` command of each worker. Ports common to all go in the
    environment (:func:`worker_env`); what differs per worker is a flag, never a
    listener's port flag, which :class:`LocalCluster` would rewrite on a restart."""
    common = ["--host", config.server.host, "--log-level", config.server.log_level]
    # Text logs: the parent learns a worker is ready from its "ready" line.
    common += ["--log-format", "text", "--nameserver", nameserver, "--navigation", navigation]
    if config_path is not None:
        common += ["--config", str(config_path)]
    return [
        ProcessSpec(
            f"worker-{i}",
            (
                "worker",
                *common,
                "--index",
                str(i),
                "--kafka-own-port",
                str(kafka),
                "--kafka-tls-own-port",
                str(kafka_tls),
            ),
        )
        for i, (kafka, kafka_tls) in enumerate(_kafka_ports(config), start=1)
    ]


def worker_env(ports: Mapping[str, int], base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with every listener's port pinned (the same for every worker)."""
    env = dict(base)
    for name, port in ports.items():
        env[f"{ENV_PREFIX}LISTENERS__{name.upper()}__PORT"] = str(port)
    return env


def worker_config(config: GatewayConfig) -> GatewayConfig:
    """A worker's configuration: a gateway of the separated form over the parent's
    storage node (``cluster.nameservers``, set by the parent's flags), named
    ``worker-<i>`` in navigation. WebSocket listeners are the first worker's alone."""
    index = config.workers.worker
    storage = dataclasses.replace(
        config.storage, url="polymq://" + ",".join(config.cluster.nameservers)
    )
    cluster = dataclasses.replace(config.cluster, gateway_id=f"worker-{index}")
    listeners = config.listeners
    if index > 1:
        off = {
            name: dataclasses.replace(getattr(listeners, name), enabled=False)
            for name in _FIRST_WORKER_ONLY
        }
        listeners = dataclasses.replace(listeners, **off)
    # The parent's node, nameserver and navigation listen on loopback only, in plain
    # TCP: [tls] internal (mutual TLS between machines) does not apply to them.
    tls = dataclasses.replace(config.tls, internal=False)
    return dataclasses.replace(
        config, storage=storage, cluster=cluster, listeners=listeners, tls=tls
    )


def run_worker(config: GatewayConfig) -> int:
    """``polymq worker``: one gateway of ``polymq run --workers N``."""
    _die_with_parent()
    return run(worker_config(config))


def _die_with_parent() -> None:
    """Ask Linux for a SIGTERM when the parent dies (even by SIGKILL): a worker left
    behind would keep the shared ports and take connections a new parent's workers
    should get. Elsewhere (not Linux) a worker outlives a parent killed so."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run_parent(config: GatewayConfig, config_path: Path | None) -> int:
    """``polymq run --workers N`` with N > 1, in the foreground."""
    return run_foreground(
        lambda stop: serve_parent(config, config_path, stop),
        log_level=config.server.log_level,
        log_format=config.server.log_format,
        what=f"polymq starting ({config.workers.count} workers over one engine",
    )


async def serve_parent(
    config: GatewayConfig,
    config_path: Path | None,
    stop: asyncio.Event,
    *,
    env: Mapping[str, str] | None = None,
) -> None:
    """Serve the engine to the workers and keep them running until ``stop``."""
    register_batch_formats()
    engine = Engine(engine_config(config))
    nameserver = Nameserver(host=_LOOPBACK, port=0, node_expiry_ms=config.nameserver.node_expiry_ms)
    navigation = NavigationServer(
        host=_LOOPBACK, port=0, gateway_expiry_ms=config.navigation.gateway_expiry_ms
    )
    async with nameserver, navigation:
        ns_host, ns_port = nameserver.address
        node = StorageNode(
            engine,
            "workers-engine",
            host=_LOOPBACK,
            port=0,
            nameservers=[f"{ns_host}:{ns_port}"],
            heartbeat_ms=config.cluster.heartbeat_ms,
        )
        await node.start()
        try:
            log.info("engine: %s, durability %s", engine.config.data_dir, config.storage.durability)
            log.info("engine served to the workers on %s:%d (storage RPC)", *node.address)
            ports = listener_ports(config)
            specs = worker_specs(config, config_path, f"{ns_host}:{ns_port}", navigation.url)
            children = LocalCluster(
                specs,
                echo=lambda line: print(line, file=sys.stderr, flush=True),
                env=worker_env(ports, os.environ if env is None else env),
                keep_lines=200,
            )
            await _supervise(config, children, ports, stop)
        finally:
            await node.close()


async def _supervise(
    config: GatewayConfig,
    children: LocalCluster,
    ports: Mapping[str, int],
    stop: asyncio.Event,
) -> None:
    try:
        # All at once: each worker's start-up is mostly its own imports.
        try:
            await asyncio.gather(*(children.start(name) for name in children.children))
        except RuntimeError as e:
            first_line = str(e).splitlines()[0]
            raise WorkerStartError(f"{first_line} (its log above says why)") from e
        host = config.server.host
        for name, port in ports.items():
            if name in TLS_LISTENERS and not config.tls.cert_file:
                continue
            announce(log, "listener %s: %s:%d (shared by the workers)", name, host, port)
        for name, child in children.children.items():
            own = child.addresses.get("kafka")
            pid = child.process.pid if child.process is not None else 0
            if own is not None:
                announce(log, "%s: pid %d, own Kafka port %d", name, pid, own[1])
        supervisor = Supervisor(
            children,
            status_path=Path(config.storage.data_dir) / STATUS_FILE,
            log=lambda line: log.warning("%s", line.replace("polymq cluster: ", "")),
        )
        announce(log, "ready (pid %d)", os.getpid())
        supervising = asyncio.create_task(supervisor.run())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({supervising, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        supervising.cancel()  # first: no worker is restarted while they stop
        with contextlib.suppress(asyncio.CancelledError):
            await supervising
        log.info("stopping the workers")
        await asyncio.gather(*(children.stop(name) for name in children.children))
        supervisor.write_status(running=False)
    finally:
        await children.stop()
