"""Per-connection traffic (``ConnectionRegistry.count_traffic``): what metering counts
goes to the connection the running task serves, only under that connection's own
protocol, and to no connection outside one (the admin API's and console's rates)."""

from __future__ import annotations

from polymq.gateway.connections import ConnectionRegistry, serving_connection
from polymq.gateway.metering import Metering
from polymq.storage.clock import ManualClock


async def _close() -> None:
    pass


def test_counts_go_to_the_serving_connection_and_its_protocol_only() -> None:
    metering = Metering()
    reg = ConnectionRegistry(max_connections=10, metering=metering, clock=ManualClock())
    a = reg.register(protocol="amqp", peer="127.0.0.1:1", close=_close)
    b = reg.register(protocol="kafka", peer="127.0.0.1:2", close=_close)
    with serving_connection(a.id):
        metering.record_in("ns", "amqp", messages=2, nbytes=10)
        metering.record_out("ns", "amqp", messages=1, nbytes=4)
        # A protocol's own bookkeeping, metered under another name: not the client's.
        metering.record_in("ns", "amqp.changes", messages=1, nbytes=200)
    metering.record_in("ns", "http", messages=5, nbytes=50)  # no connection's task
    traffic = reg.traffic(a.id)
    assert traffic is not None
    counted = (traffic.messages_in, traffic.bytes_in, traffic.messages_out, traffic.bytes_out)
    assert counted == (2, 10, 1, 4)
    assert reg.traffic(b.id) is None  # nothing counted for it: none, not zeros
    reg.unregister(a.id)
    assert reg.traffic(a.id) is None
    with serving_connection(a.id):  # late counts of a closed connection are dropped
        metering.record_in("ns", "amqp", messages=1, nbytes=1)
    assert reg.traffic(a.id) is None
