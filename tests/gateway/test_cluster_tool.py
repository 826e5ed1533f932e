from __future__ import annotations

from pathlib import Path

from polymq.gateway.cluster_status import render
from polymq.gateway.cluster_tool import layout
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
