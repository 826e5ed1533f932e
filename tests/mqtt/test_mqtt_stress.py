"""Many clients at once: persistent subscribers that drop and come back while
publishers keep going lose no QoS 1 message, and the server stays healthy."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.mqtt.helpers import Paho, mqtt_server, wait_until

PUBLISHERS = 4
EACH = 150
SUBSCRIBERS = 5


def test_reconnecting_persistent_subscribers_miss_nothing(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")

        def subscriber(i: int) -> Paho:
            return Paho(port, v5=i % 2 == 0, client_id=f"s{i}", clean=False, session_expiry=600)

        subs = [subscriber(i).connect() for i in range(SUBSCRIBERS)]
        for sub in subs:
            sub.subscribe("load/#", qos=1)
        seen: list[set[bytes]] = [set() for _ in range(SUBSCRIBERS)]

        def publish(p: int) -> None:
            pub = Paho(port, v5=p % 2 == 1).connect()
            for n in range(EACH):
                pub.publish(f"load/{p}", f"{p}-{n}".encode(), qos=1)
            pub.disconnect()

        threads = [threading.Thread(target=publish, args=(p,)) for p in range(PUBLISHERS)]
        for thread in threads:
            thread.start()
        # every subscriber drops (abruptly or not) and comes back once, mid-stream
        for i in range(SUBSCRIBERS):
            wait_until(lambda s=subs[i]: len(s.messages) > 20, what="traffic")  # type: ignore[misc]
            if i % 2:
                subs[i].kill()
            else:
                subs[i].disconnect()
            seen[i].update(m.payload for m in subs[i].messages)
            subs[i] = subscriber(i).connect(clean_start=False)
        for thread in threads:
            thread.join()
        expected = {f"{p}-{n}".encode() for p in range(PUBLISHERS) for n in range(EACH)}
        for i, sub in enumerate(subs):

            def complete(i: int = i, sub: Paho = sub) -> bool:
                return seen[i] | {m.payload for m in sub.messages} >= expected

            wait_until(complete, what=f"subscriber {i} complete")


def test_shared_group_members_leaving_lose_nothing(tmp_path: Path) -> None:
    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        members = [Paho(port, v5=True).connect() for _ in range(3)]
        for member in members:
            member.subscribe("$share/crew/work/#", qos=1)
        total = 400

        def publish() -> None:
            pub = Paho(port).connect()
            for n in range(total):
                pub.publish(f"work/{n % 7}", str(n).encode(), qos=1)
            pub.disconnect()

        thread = threading.Thread(target=publish)
        thread.start()
        gone: list[Paho] = []
        for leaving in members[:2]:  # two of three members vanish mid-stream
            wait_until(lambda m=leaving: len(m.messages) > 10, what="work")  # type: ignore[misc]
            leaving.kill()
            gone.append(leaving)
        thread.join()
        last = members[2]

        def all_done() -> bool:
            got = {m.payload for m in last.messages}
            for member in gone:
                got |= {m.payload for m in member.messages}
            return got >= {str(n).encode() for n in range(total)}

        wait_until(all_done, what="every message handled by the group")


def test_qos2_publisher_reconnecting_delivers_exactly_once(tmp_path: Path) -> None:
    import socket
    import time

    with mqtt_server(tmp_path) as server:
        port = server.port("mqtt")
        sub = Paho(port, v5=True).connect()
        sub.subscribe("exact/#", qos=2)
        pub = Paho(port, client_id="exact-pub", clean=False)
        pub.client.reconnect_delay_set(0, 1)
        pub.connect()
        total = 200
        for n in range(total):
            pub.publish("exact/t", str(n).encode(), qos=2, wait=False)
            if n in (60, 140):  # cut the line under paho: it reconnects and resends
                raw = pub.client.socket()
                if isinstance(raw, socket.socket):
                    raw.shutdown(socket.SHUT_RDWR)
                time.sleep(0.05)
        wait_until(lambda: len(sub.messages) >= total, what="all messages")
        # A duplicate from paho's resends would be stored before this barrier, which
        # is published after every message has arrived.
        pub.publish("exact/t", b"barrier", qos=2)
        wait_until(lambda: sub.messages[-1].payload == b"barrier", what="the barrier")
        payloads = [m.payload for m in sub.messages[:-1]]
        assert sorted(payloads, key=int) == [str(n).encode() for n in range(total)]
        assert len(pub.disconnects) == 2  # the line was really cut, twice
