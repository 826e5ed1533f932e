"""One status line for long runs (``polymq conformance``, the benchmarks): how many
steps are done out of how many, which one runs now, and the time since the start,
redrawn in place on a terminal once a second, and nothing at all when the output is
not a terminal (a CI log, a pipe, a file) or ``CI`` is set, so logs stay clean.

Thread-safe: the conformance runner reports from its worker threads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TextIO

__all__ = ["Progress", "wanted"]

_REDRAW_S = 1.0
_CLEAR = "\r\x1b[K"


def wanted(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """Whether a live line belongs on ``stream``: a terminal, not a dumb one, not CI."""
    env = os.environ if env is None else env
    if env.get("CI") or env.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Progress:
    """``with Progress(total, "conformance") as p: p.started(name); ...; p.finished(name)``.
    ``note(text)`` prints a line that stays (a failure), above the live one."""

    def __init__(
        self,
        total: int | None,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = wanted(self._stream) if enabled is None else enabled
        self._total = total
        self._label = label
        self._clock = clock
        self._start = clock()
        self._done = 0
        self._running: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def line(self) -> str:
        """The status line as it is drawn now (without the terminal's controls)."""
        count = f"{self._done}/{self._total}" if self._total is not None else f"{self._done}"
        current = self._running[-1] if self._running else ""
        more = f" (+{len(self._running) - 1})" if len(self._running) > 1 else ""
        label = f"{self._label} " if self._label else ""
        return f"{label}[{count}] {_clock(self._clock() - self._start)} {current}{more}".rstrip()

    def __enter__(self) -> Progress:
        if self.enabled:
            self._ticker = threading.Thread(target=self._tick, daemon=True, name="progress")
            self._ticker.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.enabled:
            with self._lock:
                self._stream.write(_CLEAR)
                self._stream.flush()

    def started(self, name: str) -> None:
        with self._lock:
            self._running.append(name)
            self._draw()

    def finished(self, name: str) -> None:
        with self._lock:
            if name in self._running:
                self._running.remove(name)
            self._done += 1
            self._draw()

    def step(self, name: str) -> None:
        """For a run of one step at a time: what ran is done, ``name`` runs now."""
        with self._lock:
            self._done += len(self._running)
            self._running = [name]
            self._draw()

    def note(self, text: str) -> None:
        """A line that stays, printed whether or not the live line is drawn."""
        with self._lock:
            prefix = _CLEAR if self.enabled else ""
            self._stream.write(f"{prefix}{text}\n")
            self._draw()

    def _draw(self) -> None:
        if self.enabled:
            self._stream.write(_CLEAR + self.line())
            self._stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(_REDRAW_S):
            with self._lock:
                self._draw()
