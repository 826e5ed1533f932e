"""A server's CPU time over one case, to the nanosecond where Linux allows it.

psutil's user + system times count in clock ticks (10 ms): a broker that spends 5 µs
per message reads 0 over a few hundred messages, so a short case (``--quick``) shows no
CPU at all and no ratio. Each thread's ``/proc/PID/task/TID/schedstat`` counts its time
on a CPU in nanoseconds; summed over the threads it is the process's CPU, as long as
no thread ended meanwhile (an ended thread's time leaves the sum). So the sums are used
when every thread seen at the start is still there at the end, and psutil's ticks
(which keep ended threads' time) otherwise, or where schedstat is missing.
"""

from __future__ import annotations

from pathlib import Path

from bench._server import Meter

__all__ = ["CpuSpan"]


def _threads_ns(pid: int) -> dict[str, int] | None:
    """Nanoseconds on a CPU per live thread, or None where schedstat cannot be read."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    times: dict[str, int] = {}
    for task in tasks:
        try:
            times[task.name] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended between the listing and the read
    return times or None


class CpuSpan:
    """``span = CpuSpan(pid)`` at the start, ``span.seconds()`` at the end: the
    process's CPU seconds in between (0 with no pid, as ``Meter``)."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid
        self._meter = Meter(pid)
        self._ticks = self._meter.cpu()
        self._ns = _threads_ns(pid) if pid is not None else None

    def seconds(self) -> float:
        ticks = self._meter.cpu() - self._ticks
        if self._pid is None or self._ns is None:
            return ticks
        after = _threads_ns(self._pid)
        if after is None or not self._ns.keys() <= after.keys():
            return ticks
        return sum(ns - self._ns.get(tid, 0) for tid, ns in after.items()) / 1e9
