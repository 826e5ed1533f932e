"""``polymq run --workers N`` as a real subprocess on free ports, for the tests of
tests/workers: its output read as it comes (shared ports, worker pids, their own
Kafka ports, restarts), and which worker process holds a client's connection, read
from /proc (the kernel's answer, not the server's)."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Message, Producer

from polymq.gateway.config import ENV_PREFIX
from polymq.storage.replicated.local_nats import free_ports

__all__ = [
    "TIMEOUT",
    "Workers",
    "consume_values",
    "owner_pid",
    "produce_values",
    "running_workers",
    "source_port_on",
    "wait_until",
]

TIMEOUT = 60.0
LISTENERS = ("kafka", "amqp", "mqtt", "mqtt_ws", "rocketmq", "http")
# Heartbeats every 200 ms and a silent worker dropped from the directory after 2 s,
# as tests/cluster does: a killed worker's Kafka groups move within seconds.
_FAST = {
    "CLUSTER__HEARTBEAT_MS": "200",
    "NAVIGATION__GATEWAY_EXPIRY_MS": "2000",
    "NAMESERVER__NODE_EXPIRY_MS": "2000",
}
_WORKER = re.compile(
    r"polymq\.workers: (?P<name>worker-\d+): pid (?P<pid>\d+), own Kafka port (?P<port>\d+)"
)
_RESTARTED = re.compile(r"(?P<name>worker-\d+) restarted \(pid (?P<pid>\d+)")


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class Workers:
    """A running ``polymq run --workers N``: its ports, its workers' pids (kept up to
    date across restarts) and every line it printed."""

    process: subprocess.Popen[str]
    ports: dict[str, int]
    lines: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)  # worker name -> pid
    kafka_ports: dict[str, int] = field(default_factory=dict)  # worker name -> own port
    lock: threading.Condition = field(default_factory=threading.Condition)
    reader: threading.Thread | None = None  # reads ``lines`` from the output

    def read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.rstrip("\n")
            with self.lock:
                self.lines.append(line)
                if match := _WORKER.search(line):
                    self.pids[match["name"]] = int(match["pid"])
                    self.kafka_ports[match["name"]] = int(match["port"])
                elif match := _RESTARTED.search(line):
                    self.pids[match["name"]] = int(match["pid"])
                self.lock.notify_all()

    def wait_line(self, pattern: str, what: str, after: int = 0) -> str:
        """The first line from index ``after`` on that matches ``pattern``."""
        found: list[str] = []

        def seen() -> bool:
            found[:] = [x for x in self.lines[after:] if re.search(pattern, x)]
            return bool(found) or self.process.poll() is not None

        with self.lock:
            self.lock.wait_for(seen, TIMEOUT)
        if not found:
            tail = "\n".join(self.lines[-30:])
            raise AssertionError(f"no line for {what} (exit {self.process.poll()}):\n{tail}")
        return found[0]

    def port(self, listener: str) -> int:
        return self.ports[listener]


@contextmanager
def running_workers(
    data_dir: Path, count: int = 2, *, extra: Sequence[str] = ()
) -> Iterator[Workers]:
    """``polymq run --workers count`` on free ports until the block ends, then
    SIGTERM; the block gets it once every worker logged ready. Ports are chosen before
    the server binds them, so another program can take one in between: a start that
    exits on "Address already in use" is tried again on other ports."""
    for attempt in range(1, _BIND_ATTEMPTS + 1):
        workers = _start(data_dir, count, extra)
        try:
            # One worker is today's single process, whose own ready line it is.
            ready = r"polymq\.workers: ready \(pid" if count > 1 else r"INFO polymq: ready \(pid"
            workers.wait_line(ready, "the ready line")
            assert len(workers.pids) == (count if count > 1 else 0), workers.lines[-20:]
        except AssertionError:
            _stop(workers)
            lost_a_port = any("address already in use" in line.lower() for line in workers.lines)
            if lost_a_port and attempt < _BIND_ATTEMPTS:
                continue
            raise
        break
    try:
        yield workers
    finally:
        _stop(workers)


_BIND_ATTEMPTS = 3


def _start(data_dir: Path, count: int, extra: Sequence[str]) -> Workers:
    ports = dict(zip(LISTENERS, free_ports(len(LISTENERS)), strict=True))
    argv = [sys.executable, "-m", "polymq.gateway", "run", "--workers", str(count)]
    argv += ["--data-dir", str(data_dir)]
    for name, port in ports.items():
        argv += [f"--{name.replace('_', '-')}-port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update({ENV_PREFIX + k: v for k, v in _FAST.items()})
    process = subprocess.Popen(
        [*argv, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    workers = Workers(process, ports)
    workers.reader = threading.Thread(target=workers.read, daemon=True)
    workers.reader.start()
    return workers


def _stop(workers: Workers) -> None:
    """SIGTERM (SIGKILL after ``TIMEOUT``), then every line it printed read."""
    process = workers.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if workers.reader is not None:
        workers.reader.join(TIMEOUT)


def owner_pid(client_port: int, server_port: int, pids: Sequence[int]) -> int | None:
    """Which of ``pids`` holds the server side of the loopback TCP connection from
    ``client_port`` to ``server_port``: the socket's inode from /proc/net/tcp, then
    the process whose file descriptors include it."""
    inode = _server_inode(client_port, server_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                try:
                    if os.readlink(fd) == target:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


def _server_inode(client_port: int, server_port: int) -> int | None:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            parts = row.split()
            local, remote, inode = parts[1], parts[2], int(parts[9])
            if (
                int(local.rsplit(":", 1)[1], 16) == server_port
                and int(remote.rsplit(":", 1)[1], 16) == client_port
                and inode
            ):
                return inode
    return None


def source_port_on(workers: Workers, listener: str, pid: int, *, other_than: bool = False) -> int:
    """A local port from which a connection to ``listener`` lands on worker ``pid``
    (or, ``other_than``, on another one). The kernel picks a worker by a hash of the
    connection's addresses, so the same source port lands on the same worker: a bare
    TCP probe finds one (closed with a reset, so the port is free again at once), and
    the real client binds it. A client that must not touch the wrong worker (a
    persistent MQTT session would be delivered there) connects once, to the right one."""
    server_port = workers.port(listener)
    for _ in range(64):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            probe.connect(("127.0.0.1", server_port))
            port = int(probe.getsockname()[1])
            owner = owner_pid(port, server_port, list(workers.pids.values()))
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if owner is not None and (owner != pid if other_than else owner == pid):
            return port
    raise AssertionError(f"no source port lands {'off' if other_than else 'on'} worker {pid}")


def produce_values(workers: Workers, topic: str, values: range) -> None:
    """``values`` produced with acks=all, every one acknowledged."""
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{workers.port('kafka')}", "acks": "all"})
    failures: list[KafkaError] = []

    def delivered(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            failures.append(error)

    for i in values:
        producer.produce(topic, str(i).encode(), on_delivery=delivered)
    assert producer.flush(TIMEOUT) == 0
    assert failures == []


def consume_values(consumer: Consumer, count: int, *, distinct: bool = False) -> list[int]:
    """Poll until ``count`` values (``distinct`` ones: redeliveries allowed) came."""
    got: list[int] = []

    def more() -> bool:
        message = consumer.poll(0.2)
        if message is not None:
            error, value = message.error(), message.value()
            if error is None and value is not None:
                got.append(int(value))
            elif error is not None and error.code() != KafkaError._PARTITION_EOF:
                raise AssertionError(error)
        return len(set(got) if distinct else got) >= count

    wait_until(more, f"{count} records")
    return got
