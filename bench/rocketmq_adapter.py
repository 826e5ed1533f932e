"""What polymq's own code costs per RocketMQ ``SendMessage``, without gRPC.

``bench/rocketmq.py`` measures the whole server, where grpcio's per-call cost
dominates; this calls the SendMessage activity (``protocols/rocketmq/activities/
send.py``: caller, authorization, quota, mapping, topic lookup, the storage append,
the response) directly on a gateway built in this process, one send at a time on its
event loop, with a stand-in for grpc's call context. The CPU per send is the adapter,
the processor and storage together: the part a faster gRPC server would not remove.

    .venv/bin/python -m bench.rocketmq_adapter [--flush async|sync] [--sends 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import tempfile
import time
import uuid
from typing import Any

from rocketmq.grpc_protocol import Code, definition_pb2, service_pb2

from polymq.gateway.assembly import build_gateway
from polymq.gateway.config import ENV_PREFIX, LISTENER_NAMES, load_config
from polymq.protocols.rocketmq.activities.send import send_message
from polymq.protocols.rocketmq.auth import sign
from polymq.protocols.rocketmq.listener import RocketMQListener

SENDS = 5_000


class _Context:
    """What the activities read of grpc's ``ServicerContext``: the request's metadata
    (signed as the official clients sign it), the peer, the time left."""

    def __init__(self) -> None:
        date_time = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self._metadata = (
            ("x-mq-date-time", date_time),
            ("x-mq-client-id", "bench-adapter"),
            (
                "authorization",
                "MQv2-HMAC-SHA1 Credential=, SignedHeaders=x-mq-date-time, "
                f"Signature={sign('', date_time)}",
            ),
        )

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def time_remaining(self) -> float:
        return 10.0


def _request(topic: str, size: int) -> Any:
    msg = definition_pb2.Message(body=b"x" * size)
    msg.topic.name = topic
    msg.system_properties.message_id = uuid.uuid4().hex
    msg.system_properties.message_type = definition_pb2.NORMAL
    return service_pb2.SendMessageRequest(messages=[msg])


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(data_dir: str, flush: str, sends: int, size: int) -> tuple[float, float]:
    """sends/s and CPU µs per send (this process: the loop and storage's threads)."""
    env = {f"{ENV_PREFIX}LISTENERS__{name.upper()}__ENABLED": "false" for name in LISTENER_NAMES}
    env.pop(f"{ENV_PREFIX}LISTENERS__ROCKETMQ__ENABLED")
    overrides = {
        "storage.data_dir": data_dir,
        "listeners.rocketmq.port": 0,
        "rocketmq.flush": flush,
    }
    gateway = build_gateway(load_config(None, env, overrides))
    async with gateway:
        listener = gateway.listeners.get("rocketmq")
        assert isinstance(listener, RocketMQListener)
        services, context, topic = listener.services, _Context(), f"bench-{uuid.uuid4().hex[:8]}"
        for _ in range(50):  # the topic created, caches warm
            await send_message(services, _request(topic, size), context)
        requests = [_request(topic, size) for _ in range(sends)]
        cpu, start = _cpu(), time.perf_counter()
        for request in requests:
            answer = await send_message(services, request, context)
            if answer.status.code != Code.OK:
                raise RuntimeError(f"send failed: {answer.status}")
        elapsed, used = time.perf_counter() - start, _cpu() - cpu
    return sends / elapsed, used / sends * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flush", choices=("async", "sync"), default="async")
    parser.add_argument("--sends", type=int, default=SENDS)
    parser.add_argument("--size", type=int, default=100)
    args = parser.parse_args()
    runner: Any = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    with tempfile.TemporaryDirectory(prefix="polymq-bench-") as data_dir:
        rate, per_send = runner(_measure(data_dir, args.flush, args.sends, args.size))
    print(
        f"SendMessage activity, no gRPC, flush={args.flush}, {args.size} B: "
        f"{rate:.0f} sends/s, {per_send:.0f} us CPU per send"
    )


if __name__ == "__main__":
    main()
