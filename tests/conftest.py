"""Every protocol test that starts a live server runs against both forms: the merged
server and the separated form (storage nodes, a nameserver, a gateway over them).

A test module qualifies when it, or its folder's conftest, starts servers with
:func:`tests.live_server.live_server`; it is then parametrized over ``server_form``
(module scope, so a module's shared server is built once per form) and ``live_server``
builds whichever form is current. ``pytest --form merged`` (or ``cluster``) runs one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import live_server as live

FORMS = ("merged", "cluster")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--form",
        choices=(*FORMS, "both"),
        default="merged",
        help="which form of the server live-server tests run against [both]",
    )


@functools.cache
def _starts_live_servers(module_file: str) -> bool:
    path = Path(module_file)
    sources = [path, path.parent / "conftest.py"]
    return (
        any("live_server(" in source.read_text() for source in sources if source.exists())
        and "crash" not in path.name
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server_form" not in metafunc.fixturenames:
        return
    if not _starts_live_servers(inspect.getfile(metafunc.module)):
        return
    chosen = metafunc.config.getoption("--form")
    forms = FORMS if chosen == "both" else (chosen,)
    metafunc.parametrize("server_form", forms, indirect=True, scope="module")


@pytest.fixture(scope="module", autouse=True)
def server_form(request: pytest.FixtureRequest) -> Iterator[str]:
    """The form ``live_server`` starts for this module's tests (merged when the module
    starts none). Module-scoped fixtures that start a server take it as an argument, so
    they are rebuilt when it changes."""
    form = getattr(request, "param", "merged")
    with live.server_form(form):
        yield form
