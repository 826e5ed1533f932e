"""The server under fuzz as real processes: ``polymq run`` (merged) or a nameserver,
navigation, two storage nodes and one gateway (separated), on free ports.

Built on :class:`gateway.cluster_tool.LocalCluster`, which already starts ``polymq``
children, learns their bound addresses from their logs and restarts one on its old
ports: the fuzzer needs exactly that, plus each child's pid for its memory and its
exit code for "crashed".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from polymq.gateway.cluster_tool import LocalCluster, ProcessSpec, layout
from polymq.gateway.config import ENV_PREFIX, LISTENER_NAMES
from tests.cluster.fast_failure import cluster_env

__all__ = ["FORMS", "Exit", "FuzzServer", "fuzz_settings"]

FORMS = ("merged", "cluster")

# What the fuzzed servers change from the defaults, and why: a connection that never
# finishes its handshake is closed after 3 s instead of 10 s, so the fuzzer's slow
# sends find a listener that never closes them within a short run.
DEFAULT_SETTINGS: Mapping[str, str] = {
    "limits.handshake_timeout_ms": "3000",
}


def fuzz_settings(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {**DEFAULT_SETTINGS, **(extra or {})}


@dataclass(frozen=True, slots=True)
class Exit:
    """A child that exited while it should have been serving."""

    name: str
    code: int | None
    log_tail: tuple[str, ...]


def _env(settings: Mapping[str, str]) -> dict[str, str]:
    env = cluster_env()
    for key, value in settings.items():  # dotted config keys, as the CLI's --set has them
        env[ENV_PREFIX + "__".join(key.split(".")).upper()] = value
    return env


def merged_spec(
    data_dir: Path,
    *,
    host: str = "127.0.0.1",
    ports: Mapping[str, int] | None = None,
    log_level: str = "info",
) -> ProcessSpec:
    listener_ports = [
        arg
        for name in LISTENER_NAMES
        for arg in (f"--{name.replace('_', '-')}-port", str((ports or {}).get(name, 0)))
    ]
    args = ("run", "--host", host, "--log-level", log_level, "--data-dir", str(data_dir))
    return ProcessSpec("merged", (*args, *listener_ports))


class FuzzServer:
    """One form of the server, started by :meth:`start`. ``gateway``: the child that
    serves the listeners."""

    def __init__(
        self,
        form: str,
        data_dir: Path,
        *,
        settings: Mapping[str, str] | None = None,
        specs: Sequence[ProcessSpec] | None = None,
    ) -> None:
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}")
        self.form = form
        if specs is None:
            if form == "merged":
                specs = [merged_spec(data_dir)]
            else:
                specs = layout(storage=2, gateways=1, data_dir=data_dir, port_offset=None)
        self.gateway = "merged" if form == "merged" else "gateway-1"
        self._cluster = LocalCluster(specs, env=_env(fuzz_settings(settings)))
        self._reported: set[tuple[str, int]] = set()

    async def start(self) -> None:
        await self._cluster.start()

    async def stop(self) -> None:
        await self._cluster.stop()

    async def restart(self, name: str) -> None:
        """Start an exited child again, on the ports it had."""
        await self._cluster.start(name)

    async def bounce(self, name: str | None = None) -> None:
        """Stop and start a child (the gateway by default) that lives on but no longer
        serves: a listener that died inside a live process."""
        name = name or self.gateway
        await self._cluster.stop(name)
        self._reported.update(
            (name, c.process.pid) for c in [self._cluster.children[name]] if c.process
        )
        await self._cluster.start(name)

    def address(self, listener: str) -> tuple[str, int]:
        return self._cluster.address(self.gateway, listener)

    @property
    def listeners(self) -> dict[str, tuple[str, int]]:
        child = self._cluster.children[self.gateway]
        return {k: v for k, v in child.addresses.items() if k in LISTENER_NAMES}

    def pids(self) -> dict[str, int]:
        return {
            name: child.process.pid
            for name, child in self._cluster.children.items()
            if child.process is not None and child.process.returncode is None
        }

    def rss(self) -> dict[str, int]:
        """Resident memory of every live child, bytes."""
        sizes: dict[str, int] = {}
        for name, pid in self.pids().items():
            with contextlib.suppress(psutil.Error):
                sizes[name] = psutil.Process(pid).memory_info().rss
        return sizes

    def new_exits(self) -> list[Exit]:
        """Children that exited since the last call (each exit reported once)."""
        exits = []
        for name, child in self._cluster.children.items():
            process = child.process
            if process is None or process.returncode is None:
                continue
            key = (name, process.pid)
            if key in self._reported:
                continue
            self._reported.add(key)
            exits.append(Exit(name, process.returncode, tuple(child.lines[-40:])))
        return exits

    async def wait_exit(self, timeout: float) -> bool:
        """Whether any child exits within ``timeout``: a crash caused by an input shows
        within milliseconds of it, so this waits on the processes, not on a clock."""
        waits = [
            asyncio.create_task(child.process.wait())
            for child in self._cluster.children.values()
            if child.process is not None and child.process.returncode is None
        ]
        if not waits:
            return True
        done, pending = await asyncio.wait(
            waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        return bool(done)

    def log_lines(self, name: str | None = None) -> list[str]:
        return list(self._cluster.children[name or self.gateway].lines)

    def all_log_lines(self) -> dict[str, list[str]]:
        return {name: list(child.lines) for name, child in self._cluster.children.items()}
