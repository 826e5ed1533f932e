"""MQTT 5 packets (see :mod:`tests.fuzz.targets._mqtt` for what is checked)."""

from __future__ import annotations

from polymq.protocols.mqtt.codec import LEVEL_5
from tests.fuzz.targets._mqtt import run

__all__ = ["one_input"]


def one_input(data: bytes) -> None:
    run(data, LEVEL_5)
