"""The storage node's duties besides serving: heartbeats to every nameserver (at once
after a change, independently of each other), homes that outlive restarts, and the
``serve_node`` entry point run as its own process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from polymq.protocols.kafka.records import KafkaRecord, encode_batch
from polymq.storage.engine.ids import load_node_id
from polymq.storage.errors import StorageClosed
from polymq.storage.model import AppendRequest, BatchEntry, QueueRef, TopicConfig
from polymq.storage.node import HOME_KIND, StorageNode
from polymq.storage.remote import RemoteStorage
from polymq.storage.routes import NodeHeartbeat
from polymq.storage.rpc import RpcServer
from tests.storage.conftest import EngineFactory

WAIT = 10.0  # seconds: a generous bound on waiting for a condition
NS = "default"


class FakeNameserver:
    """A real RPC server with the nameserver's ``heartbeat`` method, recording."""

    def __init__(self) -> None:
        self.beats: list[NodeHeartbeat] = []
        self._arrived = asyncio.Event()
        self.server = RpcServer({"heartbeat": self.heartbeat})

    async def heartbeat(self, hb: NodeHeartbeat) -> int:
        self.beats.append(hb)
        self._arrived.set()
        return len(self.beats)

    @property
    def address(self) -> str:
        host, port = self.server.address
        return f"{host}:{port}"

    async def beat_where(self, condition: Callable[[NodeHeartbeat], bool]) -> NodeHeartbeat:
        async with asyncio.timeout(WAIT):
            while True:
                for hb in self.beats:
                    if condition(hb):
                        return hb
                self._arrived.clear()
                await self._arrived.wait()


@pytest.fixture
async def nameservers() -> AsyncIterator[Callable[[], FakeNameserver]]:
    started: list[FakeNameserver] = []

    def make() -> FakeNameserver:
        fake = FakeNameserver()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.server.close()


@pytest.fixture
async def silent_nameserver() -> AsyncIterator[str]:
    """Accepts connections and never answers (a hung nameserver)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        with contextlib.suppress(ConnectionError):
            await reader.read()

    listener = await asyncio.start_server(hold, "127.0.0.1", 0)
    host, port = listener.sockets[0].getsockname()[:2]
    yield f"{host}:{port}"
    for writer in held:
        writer.close()
    listener.close()


async def test_heartbeats_describe_the_node_and_follow_changes_at_once(
    make_engine: EngineFactory, nameservers: Callable[[], FakeNameserver]
) -> None:
    one, two = nameservers(), nameservers()
    await one.server.start()
    await two.server.start()
    # A long interval: only the beat a change sends can carry the new topic in time.
    node = StorageNode(
        make_engine(), "node-a", nameservers=[one.address, two.address], heartbeat_ms=600_000
    )
    await node.start()
    try:
        first = await one.beat_where(lambda hb: True)
        assert (first.node_id, first.host, first.port) == ("node-a", *node.address)
        assert first.started_ms > 0 and first.disk_free_bytes > 0
        await two.beat_where(lambda hb: True)
        remote = RemoteStorage(*node.address)
        try:
            await remote.create_topic(NS, "t")
            await remote.create_topic(NS, "session", TopicConfig(internal=True))
            for fake in (one, two):
                await fake.beat_where(
                    lambda hb: {("default", "t"), ("default", "session")} <= set(hb.topics)
                )
            await remote.claim_home("tenant")
            beat = await one.beat_where(lambda hb: "tenant" in hb.homes)
            assert beat.load >= 2
            await remote.delete_topic(NS, "t")
            await one.beat_where(lambda hb: ("default", "t") not in hb.topics)
        finally:
            await remote.close()
    finally:
        await node.close()


async def test_a_hung_or_dead_nameserver_does_not_hold_up_the_others(
    make_engine: EngineFactory,
    nameservers: Callable[[], FakeNameserver],
    silent_nameserver: str,
    unused_tcp_port: int,
) -> None:
    alive = nameservers()
    await alive.server.start()
    node = StorageNode(
        make_engine(),
        "node-a",
        nameservers=[silent_nameserver, f"127.0.0.1:{unused_tcp_port}", alive.address],
        heartbeat_ms=600_000,
    )
    await node.start()
    try:
        await alive.beat_where(lambda hb: True)
        for name in ("a", "b", "c"):  # each change is seen while the hung one still hangs
            await node.claim_home(name)
            await alive.beat_where(lambda hb, name=name: name in hb.homes)  # type: ignore[misc]
    finally:
        await node.close()


async def test_heartbeats_repeat_every_interval(
    make_engine: EngineFactory, nameservers: Callable[[], FakeNameserver]
) -> None:
    fake = nameservers()
    await fake.server.start()
    node = StorageNode(make_engine(), "node-a", nameservers=[fake.address], heartbeat_ms=20)
    await node.start()
    try:
        async with asyncio.timeout(WAIT):
            while len(fake.beats) < 3:
                await fake.beat_where(lambda hb: True)
                await asyncio.sleep(0.01)
    finally:
        await node.close()
    count = len(fake.beats)
    await asyncio.sleep(0.2)  # ten intervals
    assert len(fake.beats) == count  # closed: no more heartbeats


async def test_a_nameserver_that_starts_later_gets_heartbeats(
    make_engine: EngineFactory, unused_tcp_port: int
) -> None:
    node = StorageNode(
        make_engine(), "node-a", nameservers=[f"127.0.0.1:{unused_tcp_port}"], heartbeat_ms=20
    )
    await node.start()
    late = FakeNameserver()
    late.server = RpcServer({"heartbeat": late.heartbeat}, "127.0.0.1", unused_tcp_port)
    try:
        await late.server.start()
        await late.beat_where(lambda hb: hb.node_id == "node-a")
    finally:
        await node.close()
        await late.server.close()


async def test_homes_and_node_id_survive_a_restart(make_engine: EngineFactory) -> None:
    engine = make_engine()
    async with StorageNode(engine) as node:
        node_id = node.node_id
        assert node_id == load_node_id(Path(engine.config.data_dir)).hex()
        await node.claim_home("tenant")  # creates the namespace
        await node.claim_home("tenant")  # and is idempotent
        await node.claim_home(NS)
        assert await engine.list_namespaces() == [NS, "tenant"]
        assert await engine.meta_list("tenant", HOME_KIND) != {}
    async with StorageNode(make_engine()) as node:
        assert node.node_id == node_id
        info = await node.node_info()
        assert info.homes == (NS, "tenant")
        remote = RemoteStorage(*node.address)
        try:
            assert _steady(await remote.node_info()) == _steady(info)
            await remote.delete_namespace("tenant")
            assert (await remote.node_info()).homes == (NS,)
        finally:
            await remote.close()


def _steady(info: NodeHeartbeat) -> NodeHeartbeat:
    """``info`` without what changes between two reports (free disk, load): other
    tests write to the same disk meanwhile."""
    return dataclasses.replace(info, disk_free_bytes=0, load=0.0)


async def test_node_info_before_start_has_no_id(make_engine: EngineFactory) -> None:
    node = StorageNode(make_engine())
    with pytest.raises(RuntimeError):
        _ = node.node_id


async def test_serve_node_runs_a_node_process_that_expands_kafka_batches(
    tmp_path: Path, nameservers: Callable[[], FakeNameserver]
) -> None:
    """The node's process registers the kafka.v2 expander itself: a raw-only Kafka
    batch appended over the wire is read back message by message."""
    fake = nameservers()
    await fake.server.start()
    script = (
        "import asyncio, logging, sys\n"
        "from polymq.gateway.config import load_config\n"
        "from polymq.gateway.roles import serve_node\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "config = load_config(overrides={'storage.data_dir': sys.argv[1],"
        " 'node.port': '0', 'cluster.nameservers': sys.argv[2],"
        " 'cluster.heartbeat_ms': '50'})\n"
        "asyncio.run(serve_node(config, asyncio.Event()))\n"
    )
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "node"), fake.address],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        beat = await fake.beat_where(lambda hb: True)
        remote = RemoteStorage(beat.host, beat.port)
        try:
            records = [
                KafkaRecord(offset_delta=i, timestamp_ms=5, key=None, value=b"%d" % i)
                for i in range(2)
            ]
            raw = encode_batch(0, records)
            await remote.create_topic(NS, "k")
            queue = QueueRef(NS, "k")
            entry = BatchEntry(format="kafka.v2", raw=raw, count=2)
            await remote.append([AppendRequest(entry=entry, queues=(queue,))])
            read = await remote.read(queue, 0)
            assert [m.message.body for m in read.messages] == [b"0", b"1"]
            assert beat.node_id == load_node_id(tmp_path / "node").hex()
        finally:
            await remote.close()
    finally:
        process.terminate()
        output, _ = await asyncio.to_thread(process.communicate, timeout=WAIT)
    text = output.decode()
    for fact in ("id ", "listening on", "data in", "nameservers", "ready"):
        assert f"storage node: {fact}" in text, text


async def test_a_taken_port_fails_start_and_closes_the_engine(make_engine: EngineFactory) -> None:
    async with StorageNode(make_engine(), "node-a") as first:
        engine = make_engine(data_dir=Path(first.engine.config.data_dir).parent / "other")
        second = StorageNode(engine, "node-b", *first.address)
        with pytest.raises(OSError):
            await second.start()
        with pytest.raises(StorageClosed):
            await engine.list_namespaces()
