"""One module per protocol, each with a ``registry`` of cases. Modules are imported
only for the protocols asked for, so a run of the MQTT part needs only MQTT clients."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from polymq.conformance.runner import Case, Registry

__all__ = ["PROTOCOLS", "cases_for"]

PROTOCOLS = ("kafka", "amqp", "mqtt", "rocketmq", "mns")


def cases_for(protocols: Sequence[str]) -> list[Case]:
    cases: list[Case] = []
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r} (known: {', '.join(PROTOCOLS)})")
        module = importlib.import_module(f"{__name__}.{protocol}")
        registry: Registry = module.registry
        cases += registry.cases
    return cases
