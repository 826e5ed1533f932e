"""A NATS cluster of local ``nats-server`` processes, for the tests and benches that
run the replicated pool and kill its servers. Every port is any free one: the first
server's are learned from its log, the others route to it, and gossip joins them all;
a restarted server keeps its ports, so the others find it again."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

from polymq.storage.replicated.nats_servers import NatsServerSpec, nats_server_binary, write_config

__all__ = ["LocalNats", "free_ports"]

_CLIENT = re.compile(r"Listening for client connections on (?P<host>[^\s:]+):(?P<port>\d+)")
_ROUTE = re.compile(r"Listening for route connections on (?P<host>[^\s:]+):(?P<port>\d+)")
_READY_TIMEOUT_S = 30.0


@dataclass
class _Server:
    spec: NatsServerSpec
    process: asyncio.subprocess.Process | None = None
    lines: list[str] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None


class LocalNats:
    """``count`` JetStream servers under ``directory``; ``sync_always`` makes each
    fsync every write. Use as ``async with LocalNats(dir, 3) as nats: nats.urls``."""

    def __init__(self, directory: Path, count: int = 3, *, sync_always: bool = False) -> None:
        self._servers = [
            _Server(
                NatsServerSpec(
                    name=f"n{i + 1}",
                    store_dir=directory / f"n{i + 1}",
                    sync_always=sync_always,
                    clustered=count > 1,
                )
            )
            for i in range(count)
        ]
        self._clustered = count > 1

    @property
    def urls(self) -> list[str]:
        return [f"nats://{s.spec.host}:{s.spec.port}" for s in self._servers]

    @property
    def url(self) -> str:
        """All servers in one URL, as ``nats://`` storage URLs take them."""
        return "nats://" + ",".join(f"{s.spec.host}:{s.spec.port}" for s in self._servers)

    def pid(self, index: int) -> int:
        process = self._servers[index].process
        assert process is not None
        return process.pid

    async def start(self) -> None:
        """Start every server. A JetStream cluster needs its route ports before it
        starts, so those are picked free beforehand; client ports are the servers'."""
        if self._clustered:
            ports = free_ports(len(self._servers))
            routes = [f"{s.spec.host}:{p}" for s, p in zip(self._servers, ports, strict=True)]
            for server, port, own in zip(self._servers, ports, routes, strict=True):
                others = tuple(r for r in routes if r != own)
                server.spec = replace(server.spec, cluster_port=port, routes=others)
        for server in self._servers:
            await self._start(server)

    async def _start(self, server: _Server) -> None:
        config = write_config(server.spec)
        server.ready.clear()
        server.process = await asyncio.create_subprocess_exec(
            nats_server_binary(),
            "-c",
            str(config),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        server.pump = asyncio.create_task(self._read_log(server, server.process))
        ready = asyncio.create_task(server.ready.wait())
        died = asyncio.create_task(server.process.wait())
        done, _ = await asyncio.wait(
            {ready, died}, timeout=_READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        ready.cancel()
        died.cancel()
        if ready not in done:
            tail = "\n".join(server.lines[-20:])
            raise RuntimeError(f"nats-server {server.spec.name} did not start:\n{tail}")

    async def _read_log(self, server: _Server, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        async for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip()
            server.lines.append(line)
            del server.lines[:-200]
            if match := _CLIENT.search(line):
                server.spec = replace(server.spec, port=int(match["port"]))
            elif match := _ROUTE.search(line):
                server.spec = replace(server.spec, cluster_port=int(match["port"]))
            elif line.endswith("Server is ready"):
                server.ready.set()

    async def kill(self, index: int, signum: int = signal.SIGKILL) -> None:
        server = self._servers[index]
        if server.process is None or server.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            server.process.send_signal(signum)
        if signum in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            await server.process.wait()
            if server.pump is not None:
                await server.pump

    async def restart(self, index: int) -> None:
        await self.kill(index)
        await self._start(self._servers[index])

    async def stop(self) -> None:
        for index in range(len(self._servers)):
            server = self._servers[index]
            if server.process is not None and server.process.returncode is None:
                server.process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(server.process.wait(), 10)
                except TimeoutError:
                    await self.kill(index)
            if server.pump is not None:
                with contextlib.suppress(Exception):
                    await server.pump

    async def wait_jetstream(self, timeout_s: float = 30.0) -> None:
        """Until JetStream answers (a cluster first elects its meta leader)."""
        import nats

        nc = await nats.connect(self.urls, connect_timeout=2, max_reconnect_attempts=-1)
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    try:
                        await nc.jetstream().account_info()
                        return
                    except Exception:
                        await asyncio.sleep(0.1)
        finally:
            await nc.close()

    async def __aenter__(self) -> LocalNats:
        try:
            await self.start()
            await self.wait_jetstream()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports free now (all held open together so they differ); a small race with
    other programs remains, as with any port chosen before the server binds it."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
