"""The epoll that holds idle MQTT sockets: a socket closed behind its back is let go
without an error, so its owner and the sockets woken with it are still served."""

from __future__ import annotations

import asyncio
import os
import socket

from polymq.protocols.mqtt.idle_sockets import IdleSockets

ONE_FORM = True


class _Owner:
    def __init__(self) -> None:
        self.woken = asyncio.Event()

    def readable(self) -> None:
        self.woken.set()


async def test_a_socket_closed_behind_its_back_is_released_without_an_error() -> None:
    idle = IdleSockets(asyncio.get_running_loop())
    ours, peer = socket.socketpair()
    try:
        fd = ours.detach()
        idle.hold(fd, _Owner())
        os.close(fd)  # the kernel drops it from the epoll: unregister would raise
        idle.release(fd)
        assert len(idle) == 0
    finally:
        peer.close()
        idle.close()


async def test_a_held_socket_wakes_its_owner_once() -> None:
    idle = IdleSockets(asyncio.get_running_loop())
    ours, peer = socket.socketpair()
    owner = _Owner()
    try:
        idle.hold(ours.fileno(), owner)
        peer.send(b"\xc0\x00")  # a PINGREQ
        async with asyncio.timeout(10):
            await owner.woken.wait()
        assert len(idle) == 0  # one-shot: the owner has its socket back
        idle.release(ours.fileno())  # a second release is a no-op
    finally:
        ours.close()
        peer.close()
        idle.close()
