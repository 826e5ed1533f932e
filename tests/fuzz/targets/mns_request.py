"""MNS XML request bodies (see :mod:`tests.fuzz.targets._mns` for what is checked)."""

from __future__ import annotations

from tests.fuzz.targets._mns import run

__all__ = ["one_input"]


def one_input(data: bytes) -> None:
    run(data, json_body=False)
