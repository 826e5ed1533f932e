"""One real ``nats-server`` with JetStream for a whole test session (tests that kill
servers start clusters of their own with :class:`storage.replicated.local_nats.LocalNats`)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from polymq.storage.replicated.nats_servers import NatsServerSpec, nats_server_binary, write_config

__all__ = ["running_nats_server"]

_CLIENT = re.compile(r"Listening for client connections on (?P<host>[^\s:]+):(?P<port>\d+)")


@contextmanager
def running_nats_server(store_dir: Path) -> Iterator[str]:
    """A lone server on a free port; yields its URL."""
    config = write_config(NatsServerSpec(name="test", store_dir=store_dir, clustered=False))
    process = subprocess.Popen(
        [nats_server_binary(), "-c", str(config)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stderr is not None
        url = None
        lines = []
        for line in process.stderr:  # ends if the server exits
            lines.append(line)
            if match := _CLIENT.search(line):
                url = f"nats://{match['host']}:{match['port']}"
            if "Server is ready" in line:
                break
        if url is None:
            raise RuntimeError("nats-server did not start:\n" + "".join(lines[-20:]))
        # Keep reading its log so it never blocks on a full pipe.
        import threading

        threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()  # type: ignore[union-attr]
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
