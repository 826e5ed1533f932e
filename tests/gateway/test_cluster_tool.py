from __future__ import annotations

from pathlib import Path

from polymq.gateway.cluster_status import render
from polymq.gateway.cluster_tool import _READY, layout
from polymq.storage.routes import NodeStatus, RouteTable


def test_layout_gives_each_process_its_own_ports_and_folder(tmp_path: Path) -> None:
    specs = layout(storage=3, gateways=2, data_dir=tmp_path, port_offset=100)
    assert [s.name for s in specs] == [
        "nameserver",
        "navigation",
        "storage-1",
        "storage-2",
        "storage-3",
        "gateway-1",
        "gateway-2",
    ]
    ports = [
        s.args[s.args.index(flag) + 1]
        for s in specs
        for flag in s.args
        if flag.endswith("-port") or flag == "--port"
    ]
    assert len(ports) == len(set(ports)), "two processes share a port"
    assert "10931" in specs[4].args and str(tmp_path / "node-3") in specs[4].args
    gateway_2 = specs[6].args
    assert gateway_2[gateway_2.index("--kafka-port") + 1] == "9192"
    assert "{nameserver}" in gateway_2 and "{navigation}" in gateway_2


def test_layout_with_free_ports_asks_for_port_zero_everywhere(tmp_path: Path) -> None:
    specs = layout(storage=1, gateways=1, data_dir=tmp_path, port_offset=None)
    ports = {s.args[i + 1] for s in specs for i, a in enumerate(s.args) if a.endswith("port")}
    assert ports == {"0"}


def test_status_report_names_dead_nodes_and_placement() -> None:
    routes = RouteTable(
        version=7,
        nodes=(
            NodeStatus(node_id="node-1", host="h", port=1, last_seen_ms=9_000),
            NodeStatus(node_id="node-2", host="h", port=2, last_seen_ms=1_000, alive=False),
        ),
        topics={("default", "orders"): "node-2", ("default", "logs"): "node-1"},
        homes={"default": "node-1"},
    )
    gateways = [
        {
            "gateway_id": "gw-1",
            "zone": "z",
            "load": 3,
            "endpoints": [{"protocol": "kafka", "host": "h", "port": 9092}],
        }
    ]
    text = render(routes, gateways, now_ms=10_000)
    lines = text.splitlines()
    node_2 = next(line for line in lines if line.startswith("node-2"))
    assert "DOWN" in node_2 and "9.0 s ago" in node_2
    assert any("orders" in line and "node-2" in line for line in lines)
    assert "kafka=h:9092" in text and "gw-1" in text


def test_layout_of_the_replicated_pool_starts_nats_first_and_gives_each_node_a_shard(
    tmp_path: Path,
) -> None:
    specs = layout(storage=3, gateways=1, data_dir=tmp_path, replicas=3)
    names = [spec.name for spec in specs]
    assert names[:3] == ["nats-1", "nats-2", "nats-3"]
    nats_ports = [spec.args[spec.args.index("--port") + 1] for spec in specs[:3]]
    assert nats_ports == ["4222", "4223", "4224"]
    routes = specs[0].args[specs[0].args.index("--routes") + 1]
    assert routes == "127.0.0.1:6223,127.0.0.1:6224"  # the others' route ports
    storage = [spec for spec in specs if spec.name.startswith("storage-")]
    for i, spec in enumerate(storage, start=1):
        args = spec.args
        assert args[args.index("--nats") + 1] == "127.0.0.1:4222,127.0.0.1:4223,127.0.0.1:4224"
        assert args[args.index("--replicas") + 1] == "3"
        assert args[args.index("--shards") + 1] == "3"
        assert args[args.index("--prefer") + 1] == f"shard-{i}"
    plain = layout(storage=3, gateways=1, data_dir=tmp_path)
    assert not any(spec.name.startswith("nats") for spec in plain)
    assert not any("--nats" in spec.args for spec in plain)


def test_status_report_shows_shard_owners_epochs_and_replicas() -> None:
    routes = RouteTable(
        version=7,
        nodes=(
            NodeStatus(node_id="shard-1", host="127.0.0.1", port=1, owner="node-2", epoch=41),
            NodeStatus(node_id="shard-2", host="127.0.0.1", port=2, owner="node-2", epoch=9),
        ),
    )
    text = render(routes, [], 0, {"shard-1": "leader n2; n1 current, n3 current"})
    section = text.split("shards (replicated pool):")[1].split("gateways:")[0]
    assert "shard-1  node-2  41" in section
    assert "leader n2; n1 current, n3 current" in section
    assert "shard-2  node-2  9" in section and "?" in section
    assert "shards (replicated pool)" not in render(
        RouteTable(version=1, nodes=(NodeStatus(node_id="n", host="h", port=3),)), [], 0
    )


def test_only_a_ready_log_record_counts_as_ready() -> None:
    """A storage process that crashed at start-up printed a traceback whose source line
    ended in "ready"; taken for its ready line, the bench killed the one process left
    serving every shard and waited 90 s for a takeover nobody could make."""
    ready = [
        "2026-12-05 06:50:55,672 INFO polymq.gateway.roles: storage node: ready",
        "2026-12-05 06:50:57,936 INFO polymq: ready (pid 20029)",
        "2026-12-05 06:50:51,253 INFO polymq.gateway.roles: ready",
        "[18922] 2026/12/05 06:50:42.908853 [INF] Server is ready",
    ]
    not_ready = [
        "    await self._tick()  # its own shards, before saying it is ready",
        "2026-12-05 06:50:55,672 ERROR polymq: not ready",
        "2026-12-05 06:50:55,672 INFO polymq.x: waiting until the pool is ready",
    ]
    assert all(_READY.search(line) for line in ready)
    assert not any(_READY.search(line) for line in not_ready)
