from __future__ import annotations

from polymq.gateway.metering import Metering, Usage, render_prometheus


def test_counts_per_namespace_and_protocol() -> None:
    m = Metering()
    m.record_in("a", "kafka", messages=3, nbytes=30)
    m.record_in("a", "kafka", messages=1, nbytes=5)
    m.record_out("a", "amqp", messages=2, nbytes=20)
    m.record_in("b", "mqtt", messages=1, nbytes=1)
    m.connection_opened("a", "kafka")
    m.connection_opened("a", "kafka")
    m.connection_closed("a", "kafka")

    assert m.snapshot() == [
        Usage(namespace="a", protocol="amqp", messages_out=2, bytes_out=20),
        Usage(
            namespace="a",
            protocol="kafka",
            messages_in=4,
            bytes_in=35,
            connections=1,
            connections_total=2,
        ),
        Usage(namespace="b", protocol="mqtt", messages_in=1, bytes_in=1),
    ]


def test_snapshot_is_detached() -> None:
    m = Metering()
    m.record_in("a", "kafka", messages=1, nbytes=1)
    before = m.snapshot()
    m.record_in("a", "kafka", messages=1, nbytes=1)
    assert before[0].messages_in == 1
    assert m.snapshot()[0].messages_in == 2


def test_prometheus_text() -> None:
    text = render_prometheus(
        [Usage(namespace="a", protocol="kafka", messages_in=4, bytes_in=35, connections=1)]
    )
    lines = text.splitlines()
    assert "# TYPE polymq_messages_in_total counter" in lines
    assert "# TYPE polymq_connections gauge" in lines
    assert 'polymq_messages_in_total{namespace="a",protocol="kafka"} 4' in lines
    assert 'polymq_bytes_in_total{namespace="a",protocol="kafka"} 35' in lines
    assert 'polymq_connections{namespace="a",protocol="kafka"} 1' in lines
    assert text.endswith("\n")
    # Each family is declared once, before its samples.
    declared = {line.split()[2]: n for n, line in enumerate(lines) if line.startswith("# TYPE")}
    assert len(declared) == len([line for line in lines if line.startswith("# TYPE")])
    for n, line in enumerate(lines):
        if not line.startswith("#"):
            assert declared[line.split("{")[0]] < n


def test_prometheus_escapes_label_values() -> None:
    text = render_prometheus([Usage(namespace='we"ird\\ns\n', protocol="mqtt", messages_out=1)])
    assert 'polymq_messages_out_total{namespace="we\\"ird\\\\ns\\n",protocol="mqtt"} 1' in text


def test_prometheus_idle_server_still_declares_families() -> None:
    text = render_prometheus([])
    assert "# HELP polymq_messages_out_total" in text
    assert "{" not in text
