"""``polymq cluster up`` and ``polymq cluster status``: the separated form as local
processes on one machine, for trying it, and for the tests and the benchmark that
kill and restart its parts.

:class:`LocalCluster` is a small supervisor: it starts a nameserver, a navigation
service, N storage nodes and M gateways (each a ``polymq`` subprocess with its own
ports and data folder) in that order, waits for each to log ``ready``, learns the
addresses each bound from its log (so every port may be 0, any free one), prefixes
every child's log lines with its name, and stops them all, gateways first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from polymq.gateway.config import LISTENER_NAMES, GatewayConfig

__all__ = ["LocalCluster", "ProcessSpec", "layout", "status", "up"]

_READY_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 15.0
# What the processes log once bound: "listening on HOST:PORT" (nameserver, navigation,
# storage node) and "listener NAME: HOST:PORT" (a gateway's protocol listeners).
_LISTENING = re.compile(r"listening on (?:\w+://)?(?P<host>[^\s:/,]+):(?P<port>\d+)")
_LISTENER = re.compile(r"listener (?P<name>\w+): (?P<host>[^\s:,]+):(?P<port>\d+)")
_PORT_FLAGS = {"main": "--port", **{n: f"--{n.replace('_', '-')}-port" for n in LISTENER_NAMES}}


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One child: its name in the logs and its ``polymq`` arguments, in which
    ``{nameserver}`` and ``{navigation}`` stand for those services' addresses, known
    once they listen."""

    name: str
    args: tuple[str, ...]


def layout(
    *,
    storage: int,
    gateways: int,
    data_dir: Path,
    host: str = "127.0.0.1",
    port_offset: int | None = 100,
    log_level: str = "info",
    extra_gateway_args: Sequence[str] = (),
) -> list[ProcessSpec]:
    """Who runs where. With ``port_offset``: the nameserver and navigation on their
    default ports, node i on 10911 + 10 i (RocketMQ's habit), gateway i on every
    default listener port + i * ``port_offset``. With ``None``: every port 0."""
    defaults = GatewayConfig()

    def port(default: int, i: int, step: int) -> str:
        return "0" if port_offset is None else str(default + i * step)

    common = ("--host", host, "--log-level", log_level)
    specs = [
        ProcessSpec("nameserver", ("nameserver", *common, "--port", port(9876, 0, 0))),
        ProcessSpec("navigation", ("navigation", *common, "--port", port(8090, 0, 0))),
    ]
    for i in range(storage):
        specs.append(
            ProcessSpec(
                f"storage-{i + 1}",
                (
                    "storage",
                    *common,
                    "--port",
                    port(defaults.node.port, i, 10),
                    "--node-id",
                    f"node-{i + 1}",
                    "--data-dir",
                    str(data_dir / f"node-{i + 1}"),
                    "--nameserver",
                    "{nameserver}",
                ),
            )
        )
    for i in range(gateways):
        listener_ports = (
            arg
            for name, listener in defaults.listeners.items()
            for arg in (_PORT_FLAGS[name], port(listener.port, i, port_offset or 0))
        )
        specs.append(
            ProcessSpec(
                f"gateway-{i + 1}",
                (
                    "gateway",
                    *common,
                    "--gateway-id",
                    f"gateway-{i + 1}",
                    "--nameserver",
                    "{nameserver}",
                    "--navigation",
                    "{navigation}",
                    *listener_ports,
                    *extra_gateway_args,
                ),
            )
        )
    return specs


class _Child:
    def __init__(
        self,
        spec: ProcessSpec,
        echo: Callable[[str], None] | None,
        env: Mapping[str, str] | None,
    ) -> None:
        self.spec = spec
        self.echo = echo
        self.env = env
        self.process: asyncio.subprocess.Process | None = None
        self.addresses: dict[str, tuple[str, int]] = {}  # "main" or a listener's name
        self.ready = asyncio.Event()
        self.lines: list[str] = []
        self._pump: asyncio.Task[None] | None = None

    async def start(self, args: Sequence[str]) -> None:
        self.ready.clear()
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "polymq.gateway",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=None if self.env is None else dict(self.env),
            start_new_session=True,  # Ctrl-C reaches the supervisor only: it stops us in order
        )
        self._pump = asyncio.create_task(self._read_log(self.process))

    async def _read_log(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if self.echo is not None:
                self.echo(f"[{self.spec.name}] {line}")
            if match := _LISTENING.search(line):
                self.addresses["main"] = (match["host"], int(match["port"]))
            elif match := _LISTENER.search(line):
                self.addresses[match["name"]] = (match["host"], int(match["port"]))
            if line.endswith(" ready") or " ready (" in line:
                self.ready.set()

    async def wait_ready(self) -> None:
        assert self.process is not None
        ready = asyncio.create_task(self.ready.wait())
        died = asyncio.create_task(self.process.wait())
        done, _ = await asyncio.wait(
            {ready, died}, timeout=_READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        ready.cancel()
        died.cancel()
        if ready not in done:
            tail = "\n".join(self.lines[-20:])
            raise RuntimeError(f"{self.spec.name} did not become ready:\n{tail}")

    def send(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    async def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.process is None:
            return
        self.send(signum)
        try:
            await asyncio.wait_for(self.process.wait(), _STOP_TIMEOUT_S)
        except TimeoutError:
            self.send(signal.SIGKILL)
            await self.process.wait()
        if self._pump is not None:
            await self._pump


class LocalCluster:
    """The processes of ``specs``, started in order. Every address is learned from
    the logs; a restarted process gets the ports it had, so the others find it."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        *,
        echo: Callable[[str], None] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: the children's whole environment (default: this process's)."""
        self.children = {spec.name: _Child(spec, echo, env) for spec in specs}

    def address(self, name: str, listener: str = "main") -> tuple[str, int]:
        return self.children[name].addresses[listener]

    @property
    def nameserver(self) -> str:
        host, port = self.address("nameserver")
        return f"{host}:{port}"

    @property
    def navigation(self) -> str:
        host, port = self.address("navigation")
        return f"http://{host}:{port}"

    def _args(self, child: _Child) -> list[str]:
        args = [
            arg.replace("{nameserver}", self.nameserver).replace("{navigation}", self.navigation)
            if "{" in arg
            else arg
            for arg in child.spec.args
        ]
        for label, (_, bound) in child.addresses.items():  # a restart keeps its ports
            flag = _PORT_FLAGS.get(label)
            if flag in args:
                args[args.index(flag) + 1] = str(bound)
        return args

    async def start(self, name: str | None = None) -> None:
        """Start one process (again), or all in order; returns once ready."""
        for child in self.children.values():
            if name is None or child.spec.name == name:
                await child.start(self._args(child))
                await child.wait_ready()

    async def kill(self, name: str) -> None:
        await self.children[name].stop(signal.SIGKILL)

    async def stop(self, name: str | None = None) -> None:
        """Stop one process, or all: gateways first, the nameserver last."""
        for child in reversed(self.children.values()):
            if name is None or child.spec.name == name:
                await child.stop()

    def exited(self) -> list[str]:
        return [
            c.spec.name
            for c in self.children.values()
            if c.process is not None and c.process.returncode is not None
        ]

    async def wait_any_exit(self) -> None:
        waits = [asyncio.create_task(c.process.wait()) for c in self.children.values() if c.process]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()


async def _up(cluster: LocalCluster) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        try:
            await cluster.start()
        except RuntimeError as e:
            print(f"polymq cluster: {e}", file=sys.stderr)
            return 1
        print("\npolymq cluster is up:")
        for name, child in cluster.children.items():
            gateway = child.spec.args[0] == "gateway"
            for label, (host, port) in child.addresses.items():
                if not (gateway and label == "main"):  # a library's own "listening on"
                    print(f"  {name:<12} {name if label == 'main' else label:<12} {host}:{port}")
        print("'polymq cluster status' shows placement and health; Ctrl-C stops all.\n")
        sys.stdout.flush()
        stopping = asyncio.create_task(stop.wait())
        exiting = asyncio.create_task(cluster.wait_any_exit())
        done, _ = await asyncio.wait({stopping, exiting}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        exiting.cancel()
        if stopping not in done:
            print(f"polymq cluster: {', '.join(cluster.exited())} exited", file=sys.stderr)
            return 1
        return 0
    finally:
        await cluster.stop()


def up(args: argparse.Namespace) -> int:
    if args.storage < 1 or args.gateways < 1:
        print("polymq cluster up: needs at least one storage node and one gateway", file=sys.stderr)
        return 2
    specs = layout(
        storage=args.storage,
        gateways=args.gateways,
        data_dir=args.data_dir,
        host=args.host,
        port_offset=args.port_offset,
        log_level=args.log_level,
    )
    return asyncio.run(_up(LocalCluster(specs, echo=lambda line: print(line, flush=True))))


def status(args: argparse.Namespace) -> int:
    from polymq.gateway.cluster_status import show

    return asyncio.run(show(args.nameserver, args.navigation))
