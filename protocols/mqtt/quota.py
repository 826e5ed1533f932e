"""MQTT's side of the account quotas (gateway.quotas, docs/quotas.md), as Mosquitto and
EMQX limit rates: a client over its produce (or request) rate is simply not read for
a while, so TCP pushes back on it and nothing it sent is refused or lost. Such an
account is also announced a small Receive Maximum (v5), so that clients honouring it
keep little in flight while their reads pause; the configured one is still what is
enforced, since some clients (paho 2.2) ignore the announcement and would otherwise be
disconnected for a throttle they did not cause. Over the consume rate, outgoing
PUBLISHes wait (protocols.mqtt.outbound).
"""

from __future__ import annotations

from collections.abc import Iterable

from polymq.gateway.config import QuotaConfig
from polymq.gateway.quotas import AccountQuota
from polymq.protocols.mqtt import codec

__all__ = ["PROTOCOL", "THROTTLED_RECEIVE_MAXIMUM", "charge_packets", "receive_maximum"]

PROTOCOL = "mqtt"
# Receive Maximum for accounts with a produce or request rate: QoS 1/2 PUBLISHes a
# client may have unacknowledged while its reads are paused.
THROTTLED_RECEIVE_MAXIMUM = 8


def receive_maximum(limits: QuotaConfig, configured: int) -> int:
    """The Receive Maximum to announce in CONNACK (v5 3.2.2.3.3) to an account with
    ``limits``."""
    if limits.produce_bytes_per_s is None and limits.requests_per_s is None:
        return configured
    return min(configured, THROTTLED_RECEIVE_MAXIMUM)


def charge_packets(quota: AccountQuota, packets: Iterable[codec.Packet]) -> int:
    """Charge one read's packets (each a request, PUBLISH payloads as produced bytes);
    returns the throttle time they leave the account owing."""
    count = nbytes = 0
    for packet in packets:
        count += 1
        if isinstance(packet, codec.Publish):
            nbytes += len(packet.payload)
    return quota.produced(PROTOCOL, nbytes, requests=count) if count else 0
