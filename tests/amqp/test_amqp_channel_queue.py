"""A channel's commands go through its own queue and task: a channel stuck in storage
never holds up another channel of the same connection (its reader reads on), and
the runs the task takes off its queue at once (publishes, acks) keep their order
with the commands after them. These guard the hand-over (channel.py's ``_Inbox``)
and any attempt to run commands in the reader instead: that was tried for issue 21
and dropped (it shortened the runs stored with one write under load).

A stuck channel is forced, not waited for: the in-process server's append of one
queue's messages holds until the test releases it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import aio_pika
import pytest

from polymq.gateway.processor import Caller
from polymq.storage.model import AppendRequest, AppendResult
from tests.amqp.conftest import WAIT_S, unique
from tests.live_server import LiveServer


def _url(server: LiveServer) -> str:
    return f"amqp://guest:guest@127.0.0.1:{server.port('amqp')}/"


def _hold_appends_to(
    server: LiveServer, queue: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Make appends to ``queue`` wait until the returned ``release`` is set;
    ``holding`` is set once one waits."""
    processor = server.gateway.processor
    real_append = processor.append
    holding, release = threading.Event(), threading.Event()

    async def append(
        caller: Caller, requests: Sequence[AppendRequest], **kwargs: Any
    ) -> list[AppendResult]:
        if any(ref.topic == "amqp:" + queue for r in requests for ref in r.queues):
            holding.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
        return await real_append(caller, requests, **kwargs)

    monkeypatch.setattr(processor, "append", append)
    return holding, release


async def _count(channel: aio_pika.abc.AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def _until_stored(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    while await _count(channel, queue) != 1:
        await asyncio.sleep(0.02)


async def test_a_channel_stuck_in_storage_does_not_hold_another_of_its_connection(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck, other = unique("stuck"), unique("other")
    async with await aio_pika.connect(_url(server)) as conn:
        publishing = await conn.channel(publisher_confirms=False)
        answering = await conn.channel()
        await publishing.declare_queue(stuck)
        holding, release = _hold_appends_to(server, stuck, monkeypatch)
        try:
            await publishing.default_exchange.publish(aio_pika.Message(b"x"), routing_key=stuck)
            assert await asyncio.to_thread(holding.wait, WAIT_S), "the append never started"
            # Read by the same reader while the publish waits in storage.
            await asyncio.wait_for(answering.declare_queue(other), WAIT_S)
        finally:
            release.set()
        # Then the held publish is stored (channels are not ordered with each other).
        await asyncio.wait_for(_until_stored(answering, stuck), WAIT_S)


async def test_commands_after_a_run_of_publishes_see_them_stored(
    server: LiveServer,
) -> None:
    name = unique("inline")
    count = 300
    async with await aio_pika.connect(_url(server)) as conn:
        channel = await conn.channel(publisher_confirms=False)
        await channel.declare_queue(name)
        for i in range(count):  # written back to back: several reads of several each
            await channel.default_exchange.publish(
                aio_pika.Message(str(i).encode()), routing_key=name
            )
        assert await _count(channel, name) == count  # the channel's task, after them
        queue = await channel.get_queue(name, ensure=False)
        got: list[bytes] = []
        async with queue.iterator() as messages:
            async for message in messages:
                got.append(message.body)
                await message.ack()  # runs of acks, between deliveries
                if len(got) == count:
                    break
        assert got == [str(i).encode() for i in range(count)]
        assert await _count(channel, name) == 0
