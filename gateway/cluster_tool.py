"""``polymq cluster up`` and ``polymq cluster status``: the separated form as local
processes on one machine, for trying it and for the tests that kill its parts.

``up`` is a small supervisor: it starts a nameserver, a navigation service, N storage
nodes and M gateways (each a ``polymq`` subprocess with its own ports and data
folder), waits for each to log ``ready``, prints where everything is, prefixes every
child's log lines with its name, and stops them all, gateways first, on Ctrl-C or when
any child dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import LISTENER_NAMES, GatewayConfig

__all__ = ["ClusterLayout", "ProcessSpec", "layout", "status", "up"]

_READY_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One child process: its name in the logs and its ``polymq`` arguments."""

    name: str
    args: tuple[str, ...]
    endpoints: tuple[tuple[str, str], ...] = ()  # (label, address) printed once ready


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    nameserver: str
    navigation: str
    processes: tuple[ProcessSpec, ...] = field(default=())


def layout(
    *, storage: int, gateways: int, data_dir: Path, host: str, port_offset: int, log_level: str
) -> ClusterLayout:
    """Who listens where: the nameserver and navigation on their default ports, node
    i on 10911 + 10 i (RocketMQ's habit), gateway i on every default listener port
    + i * ``port_offset``. Pure, so the tests check the plan without starting it."""
    defaults = GatewayConfig()
    nameserver = f"{host}:{defaults.nameserver.port}"
    navigation = f"http://{host}:{defaults.navigation.port}"
    common = ("--host", host, "--log-level", log_level)
    specs = [
        ProcessSpec(
            "nameserver",
            ("nameserver", *common),
            (("nameserver", nameserver),),
        ),
        ProcessSpec(
            "navigation",
            ("navigation", *common),
            (("navigation", navigation),),
        ),
    ]
    for i in range(storage):
        port = defaults.node.port + 10 * i
        specs.append(
            ProcessSpec(
                f"storage-{i + 1}",
                (
                    "storage",
                    *common,
                    "--port",
                    str(port),
                    "--node-id",
                    f"node-{i + 1}",
                    "--data-dir",
                    str(data_dir / f"node-{i + 1}"),
                    "--nameserver",
                    nameserver,
                ),
                (("storage node", f"{host}:{port}"),),
            )
        )
    for i in range(gateways):
        ports = {
            name: listener.port + i * port_offset for name, listener in defaults.listeners.items()
        }
        specs.append(
            ProcessSpec(
                f"gateway-{i + 1}",
                (
                    "gateway",
                    *common,
                    "--gateway-id",
                    f"gateway-{i + 1}",
                    "--nameserver",
                    nameserver,
                    "--navigation",
                    navigation,
                    *(
                        arg
                        for name in LISTENER_NAMES
                        for arg in (f"--{name.replace('_', '-')}-port", str(ports[name]))
                    ),
                ),
                tuple((name, f"{host}:{ports[name]}") for name in LISTENER_NAMES),
            )
        )
    return ClusterLayout(nameserver, navigation, tuple(specs))


class _Child:
    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.process: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            *self.spec.args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the supervisor only: it stops us in order
        )
        self._pump = asyncio.create_task(self._copy_output())

    async def _copy_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            print(f"[{self.spec.name}] {line}", flush=True)
            if " ready" in line:
                self.ready.set()

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), _STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        if self._pump is not None:
            await self._pump


async def _up(plan: ClusterLayout) -> int:
    children = [_Child(spec) for spec in plan.processes]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        for child in children:  # in order: each needs the ones before it
            await child.start()
            assert child.process is not None
            ready = asyncio.create_task(child.ready.wait())
            died = asyncio.create_task(child.process.wait())
            done, _ = await asyncio.wait(
                {ready, died}, timeout=_READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            ready.cancel()
            died.cancel()
            if ready not in done:
                print(f"polymq cluster: {child.spec.name} did not start", file=sys.stderr)
                return 1
        print("\npolymq cluster is up:")
        for child in children:
            for label, address in child.spec.endpoints:
                print(f"  {child.spec.name:<12} {label:<12} {address}")
        print("Ctrl-C stops every process.\n", flush=True)
        waits = [asyncio.create_task(c.process.wait()) for c in children if c.process]
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({stopping, *waits}, return_when=asyncio.FIRST_COMPLETED)
        for task in (stopping, *waits):
            task.cancel()
        if stopping not in done:
            dead = [c.spec.name for c in children if c.process and c.process.returncode is not None]
            print(f"polymq cluster: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
            return 1
        return 0
    finally:
        for child in reversed(children):  # gateways first, the nameserver last
            await child.stop()


def up(args: argparse.Namespace) -> int:
    plan = layout(
        storage=args.storage,
        gateways=args.gateways,
        data_dir=args.data_dir,
        host=args.host,
        port_offset=args.port_offset,
        log_level=args.log_level,
    )
    if args.storage < 1 or args.gateways < 1:
        print("polymq cluster up: needs at least one storage node and one gateway", file=sys.stderr)
        return 2
    return asyncio.run(_up(plan))


def status(args: argparse.Namespace) -> int:
    from gateway.cluster_status import show

    return asyncio.run(show(args.nameserver, args.navigation))
