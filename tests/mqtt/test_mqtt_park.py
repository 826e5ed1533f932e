"""Parked connections (protocols/mqtt/tcp_listener.py): a TCP connection idle for
``park_after_s`` keeps its state but no task, and a while later hands its socket to
the listener's epoll and drops its loop transport (detached). Either way it must
still get what is published to it, wake for what its client sends (again and
again), expire on its keep-alive with its will, send its will when its client
vanishes, and close on a kick or a server stop as a busy one does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvloop

from polymq.protocols.mqtt import codec
from polymq.protocols.mqtt.options import MqttOptions
from polymq.protocols.mqtt.tcp_listener import MqttTcpListener
from tests.live_server import LiveServer
from tests.mqtt.helpers import Paho, RawClient, mqtt_server, wait_until

PARK_AFTER_S = 0.2


# One form: what is tested is the gateway's connection handling, the same in both;
# instead, both loops, since a detached socket leaves the loop's own transport.
ONE_FORM = True
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveServer]:
    options = MqttOptions(park_after_s=PARK_AFTER_S)
    with mqtt_server(tmp_path, options=options, loop_factory=LOOPS[request.param]) as live:
        yield live


def _listener(server: LiveServer) -> MqttTcpListener:
    listener = server.gateway.listeners.get("mqtt")
    assert isinstance(listener, MqttTcpListener)
    return listener


@pytest.fixture(params=["parked", "detached"])
def idle(request: pytest.FixtureRequest, server: LiveServer) -> Callable[[int], None]:
    """Waits until ``count`` connections are parked, or parked and detached."""
    listener = _listener(server)

    def wait(count: int) -> None:
        wait_until(lambda: listener.parked_connections == count, what=f"{count} parked")
        if request.param == "detached":
            wait_until(lambda: listener.detached_connections == count, what=f"{count} detached")

    return wait


def test_parked_connections_deliver_and_wake_again_and_again(
    server: LiveServer, idle: Callable[[int], None]
) -> None:
    port = server.port("mqtt")
    sub = Paho(port).connect()
    sub.subscribe("park/t", qos=1)
    pub = Paho(port).connect()
    for round_ in range(3):
        idle(2)  # both idle: the publisher wakes, the subscriber gets it
        pub.publish("park/t", f"m{round_}".encode(), qos=1)
        got = sub.wait_messages(round_ + 1)
        assert got[-1].payload == f"m{round_}".encode()
    sub.disconnect()
    pub.disconnect()


def test_a_parked_connection_answers_a_ping(
    server: LiveServer, idle: Callable[[int], None]
) -> None:
    raw = RawClient(server.port("mqtt"), level=codec.LEVEL_311)
    raw.connect("pinger", keep_alive=600)
    for _ in range(3):
        idle(1)
        raw.send(codec.PingReq())
        assert isinstance(raw.receive(), codec.PingResp)
    raw.close()


@pytest.mark.parametrize("end", ["keep-alive expires", "client vanishes"])
def test_a_parked_connection_that_ends_unasked_sends_its_will(
    server: LiveServer, idle: Callable[[int], None], end: str
) -> None:
    port = server.port("mqtt")
    watcher = Paho(port).connect()
    watcher.subscribe("park/will", qos=1)
    raw = RawClient(port, level=codec.LEVEL_311)
    keep_alive = 3 if end == "keep-alive expires" else 600
    raw.connect("leaving", keep_alive=keep_alive, will_topic="park/will", will_payload=b"gone")
    idle(2)  # well within the 4.5 s a keep-alive of 3 allows
    if end == "keep-alive expires":
        assert raw.closed() == []  # v3: closed without a word, 4.5 s after its last packet
    else:
        raw.close()  # no DISCONNECT: the will goes out
    got = watcher.wait_messages(1, "the will")
    assert got[0].payload == b"gone"
    try:
        wait_until(lambda: len(server.gateway.connections) == 1, what="the leaving one to end")
    except AssertionError as e:  # once in a clean run: say which one stayed, and how
        raise AssertionError(f"{e}: {_connections(server)}") from None
    watcher.disconnect()


def _connections(server: LiveServer) -> str:
    """Who is registered, and what the listener holds (a failure's context)."""
    listener = _listener(server)
    registered = [(c.id, c.client_id, c.peer) for c in server.gateway.connections.list()]
    return (
        f"registered {registered}; the listener serves {listener.open_connections},"
        f" {listener.parked_connections} parked, {listener.detached_connections} detached"
    )


def test_a_parked_connection_is_closed_by_a_kick(
    server: LiveServer, idle: Callable[[int], None]
) -> None:
    raw = RawClient(server.port("mqtt"))
    raw.connect("kicked", keep_alive=600)
    idle(1)
    registry = server.gateway.connections
    (conn,) = registry.list(protocol="mqtt")

    async def kick() -> None:
        await registry.close(conn.id)

    server.call(kick)
    packets = raw.closed()  # v5: DISCONNECT "server shutting down", then the close
    assert [type(p) for p in packets] == [codec.Disconnect]
    assert len(registry) == 0


def test_a_woken_connection_cancelled_before_its_task_ran_still_ends(
    server: LiveServer,
) -> None:
    """A server stop or a kick may cancel the task that a wake has just created, before
    its first step: run() never ran, so the listener starts it again to end. The
    transport's wake had already been used up, so asking it again did nothing and the
    connection stayed parked with no task (decision 15 of issue 21's note)."""
    raw = RawClient(server.port("mqtt"))
    raw.connect("woken", keep_alive=600)
    listener = _listener(server)
    wait_until(lambda: listener.parked_connections == 1, what="1 parked")
    registry = server.gateway.connections

    async def wake_and_cancel() -> None:
        (served,) = listener._served
        served.unpark()  # as bytes arriving do: a new task for run()
        assert served.task is not None
        served.task.cancel()  # in the same step: it never runs

    server.call(wake_and_cancel)
    assert raw.closed() is not None  # ended: the server closed the socket
    wait_until(lambda: len(registry) == 0, what="the connection unregistered")


def test_a_parked_subscriber_gets_a_burst_in_order(
    server: LiveServer, idle: Callable[[int], None]
) -> None:
    """What is published to a detached subscriber while it gets its transport back
    waits for it, in order."""
    port = server.port("mqtt")
    sub = Paho(port).connect()
    sub.subscribe("park/burst", qos=0)
    pub = Paho(port).connect()
    idle(2)
    bodies = [f"m{i}".encode() for i in range(200)]
    for body in bodies:
        pub.publish("park/burst", body, qos=0)
    got = sub.wait_messages(len(bodies), "the burst")
    assert [m.payload for m in got] == bodies
    sub.disconnect()
    pub.disconnect()
