"""The JSON bodies of the HTTP listener: the MNS API's JSON form (``Content-Type:
application/json``, for curl), the only HTTP route that parses a body (the admin API
takes none). See :mod:`tests.fuzz.targets._mns` for what is checked."""

from __future__ import annotations

from tests.fuzz.targets._mns import run

__all__ = ["one_input"]


def one_input(data: bytes) -> None:
    run(data, json_body=True)
