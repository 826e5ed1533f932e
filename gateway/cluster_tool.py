"""``polymq cluster up`` and ``polymq cluster status``: the separated form as local
processes on one machine, for trying it, and for the tests and the benchmark that
kill and restart its parts.

:class:`LocalCluster` starts a nameserver, a navigation service, N storage nodes and
M gateways (each a ``polymq`` subprocess with its own ports and data folder) in that
order, the ones that need nothing of each other side by side, waits for each to log
``ready``, learns the addresses each bound from its log
(so every port may be 0, any free one), prefixes every child's log lines with its
name, and stops them all, gateways first. It restarts nothing by itself: the tests
that kill a child decide when it comes back.

:class:`Supervisor` is what ``cluster up`` adds (opt-in, for a person trying the
separated form): a child that dies is restarted on its ports, after a backoff that
doubles from 0.5 s to 30 s and starts again from 0.5 s once the child stayed up
30 s, while the others go on running. Each exit and restart is logged, and the
supervisor keeps ``<data dir>/cluster-status.json`` (pids, restarts, last exits,
addresses) up to date, which ``cluster status --data-dir`` reads: a file rather than
an API, so it is there to read while the supervisor is busy or after it died.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polymq.gateway.config import LISTENER_NAMES, GatewayConfig
from polymq.storage.replicated.local_nats import free_ports

__all__ = [
    "STATUS_FILE",
    "Backoff",
    "LocalCluster",
    "ProcessSpec",
    "Supervisor",
    "describe_exit",
    "layout",
    "status",
    "up",
]

STATUS_FILE = "cluster-status.json"  # in the data dir of ``cluster up``

_READY_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 15.0
# What the processes log once bound: "listening on HOST:PORT" (nameserver, navigation,
# storage node) and "listener NAME: HOST:PORT" (a gateway's protocol listeners).
_LISTENING = re.compile(
    r"[Ll]istening (?:for client connections )?on (?:\w+://)?(?P<host>[^\s:/,]+):(?P<port>\d+)"
)  # ... and nats-server's "Listening for client connections on HOST:PORT"
# A storage process's own Prometheus endpoint (node.metrics_port).
_METRICS = re.compile(r"metrics on http://(?P<host>[^\s:/]+):(?P<port>\d+)/metrics")
_LISTENER = re.compile(r"listener (?P<name>\w+): (?P<host>[^\s:,]+):(?P<port>\d+)")
# The line a process logs once it serves: polymq's "ready" log record, nats-server's
# "Server is ready". Anchored to the log record's shape, so that no other line ending
# in "ready" (a traceback's source line did) passes for it.
_READY = re.compile(
    r"(?: INFO [\w.]+: (?:storage node: )?ready(?: \(pid \d+\))?|\[INF\] Server is ready)$"
)
# Which processes need which others to be ready before they start (anything else,
# gateways and workers, comes last): ``{nameserver}`` and ``{navigation}`` stand for
# addresses learned from those services' logs, a storage node registers with the
# nameserver and keeps its log in NATS.
_STAGE = {"nats": 0, "nameserver": 1, "navigation": 1, "storage": 2}
_LAST_STAGE = 3
_METRICS_PORT = 10915  # storage node i's /metrics: 10915 + 10 i (its node port + 4)
_PORT_FLAGS = {
    "main": "--port",
    "metrics": "--metrics-port",
    **{n: f"--{n.replace('_', '-')}-port" for n in LISTENER_NAMES},
}


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
    log_format: str = "text",
    extra_gateway_args: Sequence[str] = (),
    replicas: int = 1,
    nats_sync_always: bool = False,
) -> list[ProcessSpec]:
    """Who runs where. With ``port_offset``: the nameserver and navigation on their
    default ports, node i on 10911 + 10 i (RocketMQ's habit) with its /metrics on
    10915 + 10 i, gateway i on every
    default listener port + i * ``port_offset``. With ``None``: every port 0.

    ``replicas`` 3: the replicated pool. Three NATS servers come first (client ports
    4222 + i, route ports 6222 + i; with ``None`` free ones picked now, as a JetStream
    cluster needs its routes before it starts), then storage node i prefers shard i
    of ``storage`` shards, its log in JetStream with 3 copies."""
    if replicas not in (1, 3):
        raise ValueError(f"replicas must be 1 or 3, not {replicas}")
    defaults = GatewayConfig()

    def port(default: int, i: int, step: int) -> str:
        return "0" if port_offset is None else str(default + i * step)

    common = ("--host", host, "--log-level", log_level, "--log-format", log_format)
    specs = [
        ProcessSpec("nameserver", ("nameserver", *common, "--port", port(9876, 0, 0))),
        ProcessSpec("navigation", ("navigation", *common, "--port", port(8090, 0, 0))),
    ]
    replication: tuple[str, ...] = ()
    if replicas > 1:
        nats_specs, servers = _nats_servers(replicas, data_dir, host, port_offset, nats_sync_always)
        specs = nats_specs + specs
        replication = ("--nats", ",".join(servers), "--replicas", str(replicas))
        replication += ("--shards", str(storage))
    for i in range(storage):
        prefer = ("--prefer", f"shard-{i + 1}") if replication else ()
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
                    "--metrics-port",  # each storage process's own /metrics
                    port(_METRICS_PORT, i, 10),
                    "--data-dir",
                    str(data_dir / f"node-{i + 1}"),
                    "--nameserver",
                    "{nameserver}",
                    *replication,
                    *prefer,
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


def _nats_servers(
    count: int, data_dir: Path, host: str, port_offset: int | None, sync_always: bool
) -> tuple[list[ProcessSpec], list[str]]:
    """The NATS servers' specs and their client addresses."""
    if port_offset is None:
        ports = free_ports(2 * count, host)
        clients, routes = ports[:count], ports[count:]
    else:
        clients = [4222 + i for i in range(count)]
        routes = [6222 + i for i in range(count)]
    specs = []
    for i in range(count):
        others = ",".join(f"{host}:{p}" for j, p in enumerate(routes) if j != i)
        args = ["nats", "--name", f"n{i + 1}", "--host", host, "--port", str(clients[i])]
        args += ["--cluster-port", str(routes[i]), "--routes", others]
        args += ["--store-dir", str(data_dir / f"nats-{i + 1}")]
        if sync_always:
            args.append("--sync-always")
        specs.append(ProcessSpec(f"nats-{i + 1}", tuple(args)))
    return specs, [f"{host}:{p}" for p in clients]


class _Child:
    def __init__(
        self,
        spec: ProcessSpec,
        echo: Callable[[str], None] | None,
        env: Mapping[str, str] | None,
        keep_lines: int | None = None,
    ) -> None:
        self.spec = spec
        self.echo = echo
        self.env = env
        self.keep_lines = keep_lines
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
            if self.keep_lines is not None and len(self.lines) > 2 * self.keep_lines:
                del self.lines[: -self.keep_lines]
            if self.echo is not None:
                self.echo(f"[{self.spec.name}] {line}")
            if match := _LISTENING.search(line):
                self.addresses["main"] = (match["host"], int(match["port"]))
            elif match := _LISTENER.search(line):
                self.addresses[match["name"]] = (match["host"], int(match["port"]))
            elif match := _METRICS.search(line):
                self.addresses["metrics"] = (match["host"], int(match["port"]))
            if _READY.search(line):
                self.ready.set()

    async def wait_exit(self) -> int:
        """The exit status once the process is gone and its last log lines are read."""
        assert self.process is not None
        code = await self.process.wait()
        if self._pump is not None:
            await self._pump
        return code

    async def wait_ready(self) -> None:
        assert self.process is not None
        ready = asyncio.create_task(self.ready.wait())
        died = asyncio.create_task(self.process.wait())
        try:
            done, _ = await asyncio.wait(
                {ready, died}, timeout=_READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
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
        keep_lines: int | None = None,
    ) -> None:
        """``env``: the children's whole environment (default: this process's).
        ``keep_lines``: how many of each child's last log lines to keep (default
        all, for tests that read them; a long ``cluster up`` must not grow)."""
        self.children = {spec.name: _Child(spec, echo, env, keep_lines) for spec in specs}

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

    def _stages(self) -> list[list[_Child]]:
        """The children by start order: each stage needs only the ones before it."""
        stages: dict[int, list[_Child]] = {}
        for child in self.children.values():
            stages.setdefault(_STAGE.get(child.spec.args[0], _LAST_STAGE), []).append(child)
        return [stages[stage] for stage in sorted(stages)]

    async def start(self, name: str | None = None) -> None:
        """Start one process (again), or all, a stage at a time: a stage's processes
        start together (each one's start-up is mostly its imports, which the machine's
        cores run side by side) once the stage before is ready."""
        for stage in self._stages():
            children = [c for c in stage if name is None or c.spec.name == name]
            for child in children:
                await child.start(self._args(child))
            await asyncio.gather(*(child.wait_ready() for child in children))

    async def kill(self, name: str) -> None:
        await self.children[name].stop(signal.SIGKILL)

    async def stop(self, name: str | None = None) -> None:
        """Stop one process, or all, a stage at a time: gateways first, the
        nameserver and the NATS servers last."""
        for stage in reversed(self._stages()):
            children = [c for c in stage if name is None or c.spec.name == name]
            await asyncio.gather(*(child.stop() for child in children))

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


def describe_exit(returncode: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL`` (asyncio reports a signal as minus
    its number)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(slots=True)
class Backoff:
    """How long to wait before restarting a child: ``first`` doubling up to ``cap``
    while it keeps dying, and ``first`` again once it had stayed up ``stable_s``
    (a crash loop slows down; a rare crash is mended at once)."""

    first_s: float = 0.5
    cap_s: float = 30.0
    stable_s: float = 30.0
    _failures: int = 0

    def next(self, uptime_s: float) -> float:
        if uptime_s >= self.stable_s:
            self._failures = 0
        delay = min(self.cap_s, self.first_s * 2.0**self._failures)
        self._failures = min(self._failures + 1, 16)  # 0.5 s * 2**16 is past any cap
        return delay


@dataclass(slots=True)
class _Record:
    """What the supervisor knows of one child, as the status file shows it."""

    state: str = "running"  # "running", "restarting" or "stopped"
    started_ms: int = 0
    started_at: float = 0.0  # monotonic, for the uptime
    restarts: int = 0
    last_exit: dict[str, Any] | None = None
    next_restart_ms: int | None = None
    backoff: Backoff = field(default_factory=Backoff)


def _wall_ms() -> int:
    return int(time.time() * 1000)


class Supervisor:
    """Keeps every child of a started :class:`LocalCluster` running: :meth:`run`
    (until cancelled) waits on each, and restarts the one that exits, alone, on the
    ports it had, after its :class:`Backoff`. ``status_path``: where to keep the
    status file (written whole, then renamed, so a reader never sees half of it)."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        status_path: Path | None = None,
        log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
        backoff: Callable[[], Backoff] = Backoff,
    ) -> None:
        self.cluster = cluster
        self.status_path = status_path
        self._log = log
        now_ms, now = _wall_ms(), time.monotonic()
        self.records = {
            name: _Record(started_ms=now_ms, started_at=now, backoff=backoff())
            for name in cluster.children
        }

    async def run(self) -> None:
        self.write_status()
        async with asyncio.TaskGroup() as group:
            for name in self.cluster.children:
                group.create_task(self._keep(name), name=f"supervise {name}")

    async def _keep(self, name: str) -> None:
        child, record = self.cluster.children[name], self.records[name]
        while True:
            code = await child.wait_exit()
            uptime_s = time.monotonic() - record.started_at
            delay = record.backoff.next(uptime_s)
            how = describe_exit(code)
            record.state, record.next_restart_ms = "restarting", _wall_ms() + int(delay * 1000)
            record.last_exit = {
                "code": code,
                "reason": how,
                "at_ms": _wall_ms(),
                "uptime_s": round(uptime_s, 3),
            }
            self._log(
                f"polymq cluster: {name} exited ({how}) after {uptime_s:.1f} s; "
                f"restarting it in {delay:g} s, the others keep running"
            )
            self.write_status()
            await asyncio.sleep(delay)
            record.restarts += 1
            record.started_ms, record.started_at = _wall_ms(), time.monotonic()
            try:
                await self.cluster.start(name)
            except RuntimeError as e:  # died or hung while starting: its exit is next
                self._log(f"polymq cluster: restart {record.restarts} of {name} failed: {e}")
                await child.stop(signal.SIGKILL)
                continue
            finally:
                record.next_restart_ms = None
            record.state = "running"
            pid = child.process.pid if child.process else "?"
            self._log(f"polymq cluster: {name} restarted (pid {pid}, restart {record.restarts})")
            self.write_status()

    def status(self, *, running: bool = True) -> dict[str, Any]:
        children = []
        for name, child in self.cluster.children.items():
            record = self.records[name]
            alive = child.process is not None and child.process.returncode is None
            children.append(
                {
                    "name": name,
                    "pid": child.process.pid if child.process is not None else None,
                    "state": record.state if running else ("running" if alive else "stopped"),
                    "started_ms": record.started_ms,
                    "restarts": record.restarts,
                    "last_exit": record.last_exit,
                    "next_restart_ms": record.next_restart_ms,
                    "addresses": {k: f"{h}:{p}" for k, (h, p) in child.addresses.items()},
                }
            )
        body: dict[str, Any] = {
            "supervisor_pid": os.getpid(),
            "running": running,
            "updated_ms": _wall_ms(),
            "children": children,
        }
        with contextlib.suppress(KeyError):
            body["nameserver"] = self.cluster.nameserver
            body["navigation"] = self.cluster.navigation
        body["nats"] = [
            f"{h}:{p}"
            for name, child in self.cluster.children.items()
            if name.startswith("nats-")
            for h, p in [child.addresses["main"]]
            if "main" in child.addresses
        ]
        return body

    def write_status(self, *, running: bool = True) -> None:
        if self.status_path is None:
            return
        temporary = self.status_path.with_name(self.status_path.name + ".tmp")
        try:
            self.status_path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(self.status(running=running), indent=2) + "\n")
            os.replace(temporary, self.status_path)
        except OSError as e:  # the cluster matters more than its report
            self._log(f"polymq cluster: could not write {self.status_path}: {e}")


async def _up(cluster: LocalCluster, status_path: Path | None = None) -> int:
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
        print(
            "'polymq cluster status' shows placement, health and restarts; a process "
            "that dies is restarted; Ctrl-C stops all.\n"
        )
        sys.stdout.flush()
        supervisor = Supervisor(
            cluster, status_path=status_path, log=lambda line: print(line, flush=True)
        )
        supervising = asyncio.create_task(supervisor.run())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({stopping, supervising}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        supervising.cancel()  # first: nothing is restarted while we stop
        try:
            await supervising  # raises only for a bug of ours
        except asyncio.CancelledError:
            pass
        finally:
            await cluster.stop()
            supervisor.write_status(running=False)
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
        port_offset=args.port_offset or None,  # 0: every port any free one
        log_level=args.log_level,
        log_format=args.log_format,
        replicas=args.replicas,
        nats_sync_always=args.nats_sync == "always",
    )
    cluster = LocalCluster(specs, echo=lambda line: print(line, flush=True), keep_lines=1000)
    return asyncio.run(_up(cluster, args.data_dir / STATUS_FILE))


def status(args: argparse.Namespace) -> int:
    """Addresses not given are taken from the status file of a ``cluster up`` over
    ``--data-dir`` (which also gives the restarts), else the default ports."""
    from polymq.gateway.cluster_status import read_supervisor, show

    supervisor = read_supervisor(args.data_dir / STATUS_FILE)
    known = supervisor or {}
    nameserver = args.nameserver or known.get("nameserver") or "127.0.0.1:9876"
    navigation = args.navigation or known.get("navigation") or "http://127.0.0.1:8090"
    return asyncio.run(show(nameserver, navigation, supervisor))
