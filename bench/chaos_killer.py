"""The chaos bench's kill loop: every few seconds a random process of the chosen roles
gets SIGKILL, and is started again (same ports, same data folder) a moment later.

A role is what a child of :class:`LocalCluster` is named after (``storage-2`` is a
``storage``, ``gateway-1`` a ``gateway``), so a layout that adds processes of a new
role (NATS servers, ``nats-1``...) makes them killable with no change here."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from polymq.gateway.cluster_tool import LocalCluster

__all__ = ["Kill", "KillPlan", "Span", "kill_downtime", "kill_loop", "role_of", "victims"]

log = logging.getLogger("bench.chaos")
_RESTART_TRIES = 3


def role_of(name: str) -> str:
    return re.sub(r"-\d+$", "", name)


@dataclass(frozen=True, slots=True)
class Span:
    """A random duration in seconds, from ``"3-6"`` or ``"2"``."""

    low: float
    high: float

    @classmethod
    def parse(cls, text: str) -> Span:
        low, _, high = text.partition("-")
        span = cls(float(low), float(high or low))
        if span.low < 0 or span.high < span.low:
            raise ValueError(f"not a duration range: {text!r}")
        return span

    def pick(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low:g}-{self.high:g} s"


@dataclass(frozen=True, slots=True)
class KillPlan:
    roles: tuple[str, ...]
    kills: int | None  # stop after this many, or
    seconds: float | None  # after this long (whichever comes first)
    interval: Span  # from one restart to the next kill
    downtime: Span  # from a kill to its restart


@dataclass(slots=True)
class Kill:
    number: int
    name: str
    role: str
    killed_at: float  # time.monotonic()
    restarted_at: float | None = None  # ready again
    restart_failures: int = 0


def victims(cluster: LocalCluster, roles: Sequence[str]) -> list[str]:
    """The processes the loop may kill; a role with none in this layout is an error,
    not silently nothing killed."""
    names = list(cluster.children)
    for role in roles:
        if not any(role_of(n) == role for n in names):
            present = sorted({role_of(n) for n in names})
            raise ValueError(f"no process of role {role!r} in this layout (it has {present})")
    return [n for n in names if role_of(n) in roles]


async def _restart(cluster: LocalCluster, kill: Kill) -> None:
    for _ in range(_RESTART_TRIES):
        try:
            await cluster.start(kill.name)
            kill.restarted_at = time.monotonic()
            return
        except RuntimeError as e:  # did not become ready: say so, try again
            kill.restart_failures += 1
            log.error("restart of %s failed: %s", kill.name, e)
            await cluster.kill(kill.name)
    raise RuntimeError(f"{kill.name} did not come back after {_RESTART_TRIES} tries")


async def kill_loop(
    cluster: LocalCluster,
    plan: KillPlan,
    rng: random.Random,
    kills: list[Kill],
    progress: Counter[str],
) -> None:
    """Appends to ``kills`` as it goes (the checker reads them even if this fails)."""
    names = victims(cluster, plan.roles)
    deadline = None if plan.seconds is None else time.monotonic() + plan.seconds
    while plan.kills is None or len(kills) < plan.kills:
        await asyncio.sleep(plan.interval.pick(rng))
        if deadline is not None and time.monotonic() >= deadline:
            return
        name = rng.choice(names)
        kill = Kill(len(kills) + 1, name, role_of(name), time.monotonic())
        kills.append(kill)
        await cluster.kill(name)
        progress[kill.role] += 1
        await asyncio.sleep(plan.downtime.pick(rng))
        await _restart(cluster, kill)
        log.info("kill #%d %s: back after %.1f s", kill.number, name, kill_downtime(kill))


def kill_downtime(kill: Kill) -> float:
    return (kill.restarted_at or time.monotonic()) - kill.killed_at
