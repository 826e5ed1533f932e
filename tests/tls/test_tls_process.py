"""TLS in a real ``polymq run`` process (uvloop when installed, as users run it):
many handshakes in a row on the asyncio-served TLS listeners, and SIGHUP reloading
the certificate files into the running server.

The in-process servers of the other tests run on asyncio's own loop; a TLS handshake
that stalled only on uvloop (StreamWriter.start_tls) went unnoticed there."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

import trustme

from tests.tls.conftest import write_cert

ONE_FORM = True  # a subprocess of the merged form
ROOT = Path(__file__).resolve().parents[2]
HANDSHAKES = 20
TIMEOUT_S = 10.0

if str(ROOT) not in sys.path:  # bench/ is a folder of the repository, not installed
    sys.path.insert(0, str(ROOT))

from bench.tls import tls_polymq  # noqa: E402


def _served(port: int, context: ssl.SSLContext) -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), TIMEOUT_S) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_handshakes_and_sighup_reload_in_a_real_process(tmp_path: Path) -> None:
    ca = trustme.CA()
    with tls_polymq(tmp_path, ca) as (ports, pid, ca_file):
        context = ssl.create_default_context(cafile=str(ca_file))
        for listener in ("kafka_tls", "mqtts"):
            served = {_served(ports[listener], context) for _ in range(HANDSHAKES)}
            assert len(served) == 1
        (before,) = served

        write_cert(tmp_path, "server", ca.issue_cert("127.0.0.1", "localhost"))
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + TIMEOUT_S
        while _served(ports["mqtts"], context) == before:
            assert time.monotonic() < deadline, "SIGHUP did not reload the certificate"
            time.sleep(0.05)
        assert _served(ports["kafka_tls"], context) != before


def test_sighup_does_not_stop_a_nameserver(tmp_path: Path) -> None:
    """Processes with nothing to reload log SIGHUP and carry on (the default action
    would end them when an operator signals every polymq process at once)."""
    from bench._server import _polymq_env, free_port, process_server

    port = free_port()
    log = tmp_path / "nameserver.log"
    command = [sys.executable, "-m", "polymq.gateway", "nameserver", "--port", str(port)]
    with (
        log.open("wb") as stderr,
        process_server(command, port, env=_polymq_env((), {}), stderr=stderr) as server,
    ):
        assert server.pid is not None
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + TIMEOUT_S
        while b"SIGHUP: nothing to reload" not in log.read_bytes():
            assert time.monotonic() < deadline, "the nameserver did not log the SIGHUP"
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), TIMEOUT_S):
            pass  # and still serves
