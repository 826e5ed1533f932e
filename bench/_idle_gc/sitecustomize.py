"""Put first on ``PYTHONPATH`` by ``bench/idle_connections.py``: every process of the
server it starts (``polymq run``, and with ``--workers`` each worker, which inherit
the environment) answers SIGUSR1 with a ``gc.collect()`` (and, when tracemalloc is
tracing, a snapshot written to a file), acknowledged by a file the bench waits for.
So the bench reads memory after a collection in each server process, with no change
to the server itself. Python imports ``sitecustomize`` at start-up when it is on
the path."""

import gc
import os
import signal
import tracemalloc
from pathlib import Path

_OUT = Path(os.environ["IDLE_BENCH_DIR"])
_asked = 0


def _collect(signum: int, frame: object) -> None:
    global _asked
    _asked += 1
    gc.collect()
    name = f"{os.getpid()}-{_asked}"
    if tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(str(_OUT / f"snapshot-{name}"))
    (_OUT / f"done-{name}").write_text("ok")


signal.signal(signal.SIGUSR1, _collect)
