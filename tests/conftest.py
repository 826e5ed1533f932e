"""Every protocol test that starts a live server runs against both forms: the merged
server and the separated form (storage nodes, a nameserver, a gateway over them).

A test module qualifies when it, or its folder's conftest, starts servers with
:func:`tests.live_server.live_server`; it is then parametrized over ``server_form``
(module scope, so a module's shared server is built once per form) and ``live_server``
builds whichever form is current. ``pytest --form merged`` (or ``cluster``) runs one.
A module that builds its servers another way says ``ONE_FORM = True``.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import live_server as live
from tests.held_fsync import HeldFsync

FORMS = ("merged", "cluster")
_ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--form",
        choices=(*FORMS, "both"),
        default="both",
        help="which form of the server live-server tests run against [both]",
    )


_STARTS = ("live_server(", "live_gateways(")
_LOCAL_IMPORT = re.compile(r"^from (tests(?:\.\w+)+) import", re.MULTILINE)


@functools.cache
def _starts_live_servers(module_file: str) -> bool:
    """Whether the module, its folder's conftest, or a test helper module it imports
    (a protocol's harness) starts live servers."""
    path = Path(module_file)
    if "crash" in path.name:  # crash tests kill a subprocess server of the merged form
        return False
    sources = [path, path.parent / "conftest.py"]
    text = path.read_text()
    for imported in _LOCAL_IMPORT.findall(text):
        if imported != "tests.live_server":
            sources.append(_ROOT.joinpath(*imported.split(".")).with_suffix(".py"))
    return any(
        any(start in source.read_text() for start in _STARTS)
        for source in sources
        if source.exists()
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server_form" not in metafunc.fixturenames:
        return
    if getattr(metafunc.module, "ONE_FORM", False):  # builds its own servers
        return
    if not _starts_live_servers(inspect.getfile(metafunc.module)):
        return
    chosen = metafunc.config.getoption("--form")
    forms = FORMS if chosen == "both" else (chosen,)
    metafunc.parametrize("server_form", forms, indirect=True, scope="module")


# ``make test`` runs pytest-xdist with ``--dist loadgroup``: each group runs on one
# worker, in order; every module is a group of its own, so its module-scoped servers
# are built once, on one worker. Tests that kill, stop or time processes (storage
# nodes, gateways, NATS, workers) or drive many clients at once (the conformance
# suite) are marked ``one_at_a_time`` as well: `make test` runs them after the rest,
# in one process, so no other test's load shares the machine with them.
_ONE_AT_A_TIME_FOLDERS = frozenset(
    {"cluster", "replicated", "workers", "bench", "netfuzz", "conformance"}
)
_ONE_AT_A_TIME_NAMES = re.compile(r"crash|kill|flush|powerloss|failover|stress|bench")


def _xdist_group(path: Path) -> str:
    if path.parent.name in _ONE_AT_A_TIME_FOLDERS or _ONE_AT_A_TIME_NAMES.search(path.name):
        return "processes"
    return path.relative_to(_ROOT).as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = _xdist_group(item.path)
        item.add_marker(pytest.mark.xdist_group(group))
        if group == "processes":
            item.add_marker(pytest.mark.one_at_a_time)


@pytest.fixture(scope="module", autouse=True)
def server_form(request: pytest.FixtureRequest) -> Iterator[str]:
    """The form ``live_server`` starts for this module's tests (merged when the module
    starts none). Module-scoped fixtures that start a server take it as an argument, so
    they are rebuilt when it changes."""
    form = getattr(request, "param", "merged")
    with live.server_form(form):
        yield form


@pytest.fixture
def held_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldFsync]:
    """The commit log's ``fdatasync`` held once the test sets ``armed``
    (tests/held_fsync.py); released at the end, so no fsync thread is left waiting."""
    fsync = HeldFsync(monkeypatch, armed=False)
    try:
        yield fsync
    finally:
        fsync.released.set()
