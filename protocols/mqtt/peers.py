"""MQTT over several gateways: what a gateway knows of the others, and the records
they tell each other through storage.

Several gateways over one storage must behave as one broker (EMQX's cluster). What
must survive a gateway lives in storage already (session records, queues, retained
values); what the others must learn promptly (a session subscribed, a client
connected elsewhere) travels as :class:`Event` records
appended to the internal topic ``$mqtt.events`` of the namespace, which every gateway
follows with the same long-poll read the tails use. Nothing is forwarded gateway to
gateway, so no message travels two ways.

The merged form (one gateway) has no :class:`Peers`, appends no event and stamps no
message: it runs exactly as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from polymq.navigation.endpoints import GatewayDirectory, GatewayEndpoint, owner_of
from polymq.protocols import interop
from polymq.storage.model import Message, StoredMessage

__all__ = [
    "EVENTS_TOPIC",
    "GATEWAY_PROPERTY",
    "Event",
    "Peers",
    "decode_event",
    "encode_event",
    "stamp_of",
    "stamped",
]

EVENTS_TOPIC = "$mqtt.events"
# ``<events offset applied>:<gateway id>``: which gateway stored an MQTT publish (it
# routed it to every queue it knew then) and how far it had followed ``$mqtt.events``.
# The others' tails hand it to their own online clients, and copy it to the queues of
# subscriptions announced at or after that offset. Private (``mqtt.``): no consumer
# ever sees it.
GATEWAY_PROPERTY = "mqtt.gateway"
# The listeners whose gateways are MQTT peers (listener names in the directory).
MQTT_LISTENERS = ("mqtt", "mqtts", "mqtt_ws", "mqtt_wss")


@dataclass(frozen=True, slots=True)
class Peers:
    """This gateway's name and the live MQTT gateways (navigation's list)."""

    self_id: str
    directory: GatewayDirectory

    def alive(self) -> set[str]:
        return {endpoint.gateway_id for endpoint in self._endpoints()}

    def _endpoints(self) -> list[GatewayEndpoint]:
        """One endpoint per gateway serving MQTT on any of its listeners (a gateway
        may serve MQTTS alone)."""
        found: dict[str, GatewayEndpoint] = {}
        for listener in MQTT_LISTENERS:
            for endpoint in self.directory.endpoints(listener):
                found.setdefault(endpoint.gateway_id, endpoint)
        return list(found.values())

    def owns(self, key: str) -> bool:
        """Whether this gateway is the one that does ``key``'s single-copy work (the
        copies of another protocol's messages of a storage topic into queues): by
        rendezvous hash over the live gateways, so every gateway agrees and a dead
        gateway's keys move to the others."""
        owner = owner_of(key, self._endpoints())
        return owner is None or owner.gateway_id == self.self_id


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One record of ``$mqtt.events``.

    ``kind``:
    * ``session``: a session's record (``record``, as saved in storage, with the
      gateway serving it or none): the others follow its subscriptions.
    * ``gone``: the session ``incarnation`` of ``client`` ended.
    * ``attach``: ``client`` connected to ``origin``; whoever serves it closes that
      connection (taken over), and ``host`` (the gateway the record names) answers
      ``released`` with the same ``nonce`` once the session is saved.
    * ``released``: the answer to ``attach``.
    """

    kind: str
    origin: str
    client: str = ""
    record: dict[str, Any] | None = None
    incarnation: str = ""
    host: str | None = None
    nonce: str = ""


def encode_event(event: Event, now_ms: int) -> Message:
    raw: dict[str, Any] = {"k": event.kind, "o": event.origin}
    if event.client:
        raw["c"] = event.client
    if event.record is not None:
        raw["r"] = event.record
    if event.incarnation:
        raw["i"] = event.incarnation
    if event.host is not None:
        raw["h"] = event.host
    if event.nonce:
        raw["n"] = event.nonce
    return Message(body=json.dumps(raw, separators=(",", ":")).encode(), born_timestamp_ms=now_ms)


def decode_event(message: Message) -> Event | None:
    """The event a record carries, or None for one this version does not read."""
    try:
        raw = json.loads(message.body)
        return Event(
            kind=str(raw["k"]),
            origin=str(raw["o"]),
            client=str(raw.get("c", "")),
            record=raw.get("r"),
            incarnation=str(raw.get("i", "")),
            host=raw.get("h"),
            nonce=str(raw.get("n", "")),
        )
    except (ValueError, KeyError, TypeError):
        return None


def stamp_of(stored: StoredMessage) -> tuple[str, int] | None:
    """Who stored an MQTT publish, and the ``$mqtt.events`` offset that gateway had
    applied then (the second property, where :meth:`Router.publish` puts it), or
    None."""
    properties = stored.message.properties
    if len(properties) > 1 and properties[1][0] == GATEWAY_PROPERTY:
        raw: bytes | None = properties[1][1]
    else:
        raw = stored.message.property(GATEWAY_PROPERTY)
    if raw is None:
        return None
    applied, _, gateway = raw.decode("utf-8", "replace").partition(":")
    try:
        return gateway, int(applied)
    except ValueError:
        return None


def stamped(message: Message, stamp: bytes) -> Message:
    """``message`` with :data:`GATEWAY_PROPERTY` second, right after ``mqtt.topic``."""
    properties = message.properties
    head = properties[:1] if properties and properties[0][0] == interop.MQTT_TOPIC else ()
    return replace(message, properties=(*head, (GATEWAY_PROPERTY, stamp), *properties[len(head) :]))
