"""Ports for the chaos bench's processes, chosen below the kernel's ephemeral range.

A process restarted after SIGKILL must bind the ports it had, or the clients and the
other processes lose it. With every port 0, the kernel picks them from the ephemeral
range, where any outgoing connection on the machine (a client, another test run) may
take one while its owner is down; the restart then fails with "address already in
use". Ports below that range are only ever taken by someone who asks for them."""

from __future__ import annotations

import dataclasses
import random
import socket
from collections.abc import Sequence

from polymq.gateway.cluster_tool import ProcessSpec

__all__ = ["fixed_ports"]

_LOW, _HIGH = 20_000, 32_000  # below Linux's default ephemeral range (32768-60999)


def _free(port: int, host: str) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def fixed_ports(
    specs: Sequence[ProcessSpec], host: str = "127.0.0.1", rng: random.Random | None = None
) -> list[ProcessSpec]:
    """``specs`` with every ``--…port 0`` replaced by a free port of its own."""
    rng = rng or random.Random()
    taken: set[int] = set()

    def pick() -> str:
        while True:
            port = rng.randrange(_LOW, _HIGH)
            if port not in taken and _free(port, host):
                taken.add(port)
                return str(port)

    fixed = []
    for spec in specs:
        args = list(spec.args)
        for i, arg in enumerate(args[:-1]):
            if arg.startswith("--") and arg.endswith("port") and args[i + 1] == "0":
                args[i + 1] = pick()
        fixed.append(dataclasses.replace(spec, args=tuple(args)))
    return fixed
