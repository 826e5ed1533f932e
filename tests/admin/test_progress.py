"""Progress on long runs (gateway/progress.py): a live line on a terminal (cases done,
the one running, elapsed), nothing when the output is not a terminal or ``CI`` is set.
The conformance runs here target a closed port, so every case ends at once without
a server."""

from __future__ import annotations

import io
import os
import pty
import socket
import subprocess
import sys
import time
from pathlib import Path

from polymq.gateway.progress import Progress, wanted

ONE_FORM = True  # starts no server
ROOT = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_counts_names_and_times() -> None:
    now = [100.0]
    out = Terminal()
    # enabled=True: drawn as on a terminal even where CI is set (the CI run sets it).
    with Progress(3, "bench", stream=out, enabled=True, clock=lambda: now[0]) as bar:
        bar.started("kafka.produce [kafka-python]")
        now[0] += 62
        assert bar.line() == "bench [0/3] 01:02 kafka.produce [kafka-python]"
        bar.started("mqtt.qos1 [paho]")
        assert bar.line() == "bench [0/3] 01:02 mqtt.qos1 [paho] (+1)"
        bar.finished("kafka.produce [kafka-python]")
        bar.note("  FAIL kafka.produce")
        assert bar.line() == "bench [1/3] 01:02 mqtt.qos1 [paho]"
        bar.step("read")  # one step at a time (bench/storage.py): what ran is done
        assert bar.line() == "bench [2/3] 01:02 read"
    drawn = out.getvalue()
    assert "\r\x1b[K  FAIL kafka.produce\n" in drawn and drawn.endswith("\r\x1b[K")


def test_quiet_off_a_terminal_and_in_ci() -> None:
    out = io.StringIO()
    with Progress(2, stream=out) as bar:
        bar.started("x")
        bar.finished("x")
        bar.note("kept")
    assert out.getvalue() == "kept\n"
    assert not wanted(Terminal(), {"CI": "true"})
    assert not wanted(Terminal(), {"TERM": "dumb"})
    assert wanted(Terminal(), {})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conformance(stderr: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TERM")}
    args = ["-m", "polymq.gateway", "conformance", "--protocols", "mqtt"]
    args += ["--mqtt-port", str(_closed_port())]
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def test_polymq_conformance_draws_on_a_terminal_only() -> None:
    controller, terminal = pty.openpty()
    process = _conformance(terminal)
    os.close(terminal)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal's other end closed: the process is done
            break
        if not chunk:
            break
        seen += chunk
    os.close(controller)
    assert process.wait(60) == 1  # every case failed: nothing listens
    assert b"\r\x1b[K" in seen and b"conformance [" in seen
    assert b"mqtt." in seen  # the failures stay as lines

    piped = _conformance(subprocess.PIPE)
    _, err = piped.communicate(timeout=120)
    assert piped.returncode == 1
    assert b"\x1b[K" not in err and b"conformance [" not in err
    assert b"mqtt." in err
