"""Whether a peer gateway's process is gone, learned by dialling one of its listeners.

Navigation offers a gateway until it has been silent for ``gateway_expiry_ms`` (2 s in
the tests, 10 s by default), and a Kafka client told that a dead gateway leads a
partition waits for it all that while: the client only asks Metadata again, and the
answer names the same dead leader until the expiry. A SIGKILLed process, though, is
refused at once by its host's kernel, so a refused connection is certain news that
nothing listens there any more, long before the expiry says so. Only a refusal counts:
a timeout or an unreachable network may be a slow or partitioned peer, which the
expiry still judges.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping, Sequence

from polymq.navigation.endpoints import GatewayEndpoint

__all__ = ["probe_targets", "refused", "refusing"]

# Which of a peer's listeners to dial, first listed first: those that take a bare
# connect-and-close silently (a WebSocket listener logs a failed handshake for it).
_PROBE_ORDER = ("kafka", "amqp", "mqtt", "rocketmq", "http")


def probe_targets(
    lists: Mapping[str, Sequence[GatewayEndpoint]], self_id: str
) -> dict[str, tuple[str, int]]:
    """One address per peer gateway (every gateway in ``lists`` but this one): the
    listener of the first protocol in the probe order it serves. A process dies
    with all its listeners, so one of them tells for all."""
    order = [p for p in _PROBE_ORDER if p in lists] + sorted(lists.keys() - set(_PROBE_ORDER))
    targets: dict[str, tuple[str, int]] = {}
    for protocol in order:
        for endpoint in lists[protocol]:
            if endpoint.gateway_id != self_id and endpoint.host:
                targets.setdefault(endpoint.gateway_id, (endpoint.host, endpoint.port))
    return targets


async def refused(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` refuses a TCP connection. An accepted one is closed at
    once, before a byte is sent."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout, an unreachable network: not evidence of death
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


async def refusing(targets: Mapping[str, tuple[str, int]], timeout_s: float) -> set[str]:
    """The peers in ``targets`` whose listener refused, all dialled at once."""
    peers: Iterable[str] = list(targets)
    answers = await asyncio.gather(*(refused(*targets[p], timeout_s) for p in peers))
    return {p for p, no in zip(peers, answers, strict=True) if no}
