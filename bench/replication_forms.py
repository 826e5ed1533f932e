"""The four forms bench/replication.py compares, each as real processes on free ports,
and the CPU every process of a form used.

Every form runs through :class:`LocalCluster` (the merged server too, as one child),
so each is started, addressed and stopped the same way, and its processes are known by
pid: the polymq processes, and the NATS servers of the replicated ones, whose CPU is
the replication's cost and belongs in the figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from polymq.gateway.cluster_tool import LocalCluster, ProcessSpec, layout
from polymq.gateway.config import ENV_PREFIX, LISTENER_NAMES
from polymq.storage.replicated.local_nats import LocalNats

__all__ = ["FORMS", "LISTENERS", "Cpu", "Form", "bench_env", "running"]

# key -> label, in the order the tables print them (the first is the ratios' base)
FORMS = {
    "merged": "merged (local log)",
    "merged-nats": "merged (replicated log, R3)",
    "separated-r1": "separated --replicas 1",
    "separated-r3": "separated --replicas 3",
}
LISTENERS = ("kafka", "amqp", "http")  # the others are off: no scenario uses them
# As the chaos bench and tests/cluster: a dead storage process is noticed in seconds.
# The lease stays the product's default (3 s), so the takeover figure is the one a user
# gets.
_SETTINGS = {
    "CLUSTER__HEARTBEAT_MS": "200",
    "NAVIGATION__GATEWAY_EXPIRY_MS": "2000",
    "NAMESERVER__NODE_EXPIRY_MS": "2000",
}


def bench_env() -> dict[str, str]:
    """This process's environment without its ``POLYMQ_`` variables (a developer's
    settings must not change a figure), the fast failure detection, and only
    :data:`LISTENERS` enabled."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update({ENV_PREFIX + k: v for k, v in _SETTINGS.items()})
    for name in LISTENER_NAMES:
        if name not in LISTENERS:
            env[f"{ENV_PREFIX}LISTENERS__{name.upper()}__ENABLED"] = "false"
    return env


class Cpu:
    """User + system seconds of a set of processes and their children, summed. A
    process that died (a SIGKILLed one) counts with what it had used when last read."""

    def __init__(self, pids: Sequence[int]) -> None:
        self._procs: list[psutil.Process] = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                self._procs += [proc, *proc.children(recursive=True)]
        self._last: dict[int, float] = {}

    def seconds(self) -> float:
        for proc in self._procs:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                self._last[proc.pid] = float(times.user + times.system)
        return sum(self._last.values())


@dataclass
class Form:
    """A running form: where its one gateway (or merged server) listens, and its
    processes."""

    key: str
    cluster: LocalCluster
    gateway: str  # the child serving the clients
    nats: LocalNats | None = None  # the merged form's NATS servers (the separated form's
    # are children of the cluster)

    @property
    def label(self) -> str:
        return FORMS[self.key]

    def address(self, listener: str) -> tuple[str, int]:
        return self.cluster.address(self.gateway, listener)

    def pids(self) -> list[int]:
        pids = [c.process.pid for c in self.cluster.children.values() if c.process is not None]
        if self.nats is not None:
            pids += [self.nats.pid(i) for i in range(3)]
        return pids

    def cpu(self) -> Cpu:
        return Cpu(self.pids())


def _merged_spec(data_dir: Path, storage_url: str | None) -> ProcessSpec:
    args = ["run", "--data-dir", str(data_dir / "merged"), "--log-level", "info"]
    if storage_url is not None:
        args += ["--storage", storage_url]
    for name in LISTENERS:
        args += [f"--{name}-port", "0"]
    return ProcessSpec("merged", tuple(args))


# The order children start in; those of one stage start side by side (2 cores: this
# halves the separated form's start-up, which is mostly Python's). A storage process
# takes shards it does not prefer only a lease time after it started, so starting them
# together still gives each its own shard.
_STAGES = {"nats": 0, "nameserver": 1, "navigation": 1, "storage": 2, "gateway": 3, "merged": 3}


async def _start(cluster: LocalCluster) -> None:
    stages: dict[int, list[str]] = {}
    for name in cluster.children:
        stages.setdefault(_STAGES[name.rstrip("0123456789").rstrip("-")], []).append(name)
    for stage in sorted(stages):
        await asyncio.gather(*(cluster.start(name) for name in stages[stage]))


@contextlib.asynccontextmanager
async def running(
    key: str, data_dir: Path, *, nats_sync_always: bool = False
) -> AsyncIterator[Form]:
    """The form ``key`` of :data:`FORMS`, over ``data_dir``, until the block ends;
    ``nats_sync_always``: the NATS servers fsync every write (JetStream's default is
    every two minutes)."""
    nats: LocalNats | None = None
    async with contextlib.AsyncExitStack() as stack:
        if key == "merged":
            specs = [_merged_spec(data_dir, None)]
        elif key == "merged-nats":
            nats = await stack.enter_async_context(
                LocalNats(data_dir / "nats", 3, sync_always=nats_sync_always)
            )
            specs = [_merged_spec(data_dir, nats.url + "?replicas=3")]
        elif key == "separated-r1":
            specs = layout(storage=1, gateways=1, data_dir=data_dir, port_offset=None)
        elif key == "separated-r3":
            specs = layout(
                storage=3,
                gateways=1,
                data_dir=data_dir,
                port_offset=None,
                replicas=3,
                nats_sync_always=nats_sync_always,
            )
        else:
            raise ValueError(f"unknown form {key!r}; known: {', '.join(FORMS)}")
        cluster = LocalCluster(specs, env=bench_env(), keep_lines=500)
        try:
            await _start(cluster)
            gateway = "merged" if key.startswith("merged") else "gateway-1"
            yield Form(key, cluster, gateway, nats)
        finally:
            await cluster.stop()
