"""A crash of the machine, after a crash of the process: what was written but never
fsynced is gone.

A SIGKILL alone loses nothing the server wrote (the page cache survives the process),
so it cannot tell a record that was fsynced from one that was only written. Here the
server process records, for each ``fsync``/``fdatasync`` it makes, the file and the
size it had before the call (:func:`prelude`: the real calls still run; nothing is
replaced but a log line added after each). After the SIGKILL, :func:`lose_unsynced`
cuts every commit-log segment back to its last recorded fsynced size, as the disk
would hold it after a power loss, and the restarted server recovers from that.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["lose_unsynced", "prelude"]


def prelude(sync_log: Path) -> str:
    """Python for ``crash_server(prelude=...)``: log ``path<TAB>size`` per fsync, the
    size taken before the call (what the call makes durable), written once it
    returned, before the server goes on (so before any acknowledgement it allows)."""
    return f"""
import os as _os
_log = _os.open({str(sync_log)!r}, _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND, 0o644)
def _recorded(call):
    def synced(fd):
        size = _os.fstat(fd).st_size
        path = _os.readlink(f"/proc/self/fd/{{fd}}")
        call(fd)
        _os.write(_log, f"{{path}}\\t{{size}}\\n".encode())
    return synced
_os.fsync = _recorded(_os.fsync)
_os.fdatasync = _recorded(_os.fdatasync)
"""


def lose_unsynced(data_dir: Path, sync_log: Path) -> int:
    """Cut each commit-log segment of ``data_dir`` to its last fsynced size (0 if it
    was never fsynced); returns the bytes dropped."""
    synced: dict[str, int] = {}
    if sync_log.exists():
        for line in sync_log.read_text().splitlines():
            path, _, length = line.rpartition("\t")
            key = os.path.realpath(path)
            synced[key] = max(synced.get(key, 0), int(length))
    dropped = 0
    for segment in sorted((data_dir / "commitlog").glob("*.log")):
        keep = synced.get(os.path.realpath(segment), 0)
        size = segment.stat().st_size
        if size > keep:
            os.truncate(segment, keep)
            dropped += size - keep
    return dropped
