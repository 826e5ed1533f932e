"""What every MQTT connection of one gateway shares, across the TCP and WebSocket
listeners: the per-namespace brokers (so a client id taken over over TCP is taken
over from WebSocket too), counters, and the ``$SYS`` topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from dataclasses import dataclass, field

from polymq.gateway.accounts import Accounts
from polymq.gateway.config import LimitsConfig, MqttConfig
from polymq.gateway.connections import ConnectionRegistry
from polymq.gateway.fairness import FrameBudget
from polymq.gateway.listeners import ListenerContext
from polymq.gateway.metering import Metering
from polymq.gateway.processor import Processor
from polymq.gateway.quotas import Quotas
from polymq.navigation.endpoints import SingleGateway
from polymq.protocols.mqtt.broker import MqttBroker
from polymq.protocols.mqtt.deadlines import Deadlines
from polymq.protocols.mqtt.model import Delivery
from polymq.protocols.mqtt.options import MqttOptions
from polymq.protocols.mqtt.peers import Peers
from polymq.protocols.mqtt.topic_filter_index import filter_matches
from polymq.storage.clock import Clock
from polymq.storage.model import Message

__all__ = ["BrokerRegistry", "MqttServices", "Stats", "services_for", "serving"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Stats:
    started_ms: int
    connected: int = 0
    sent: int = 0
    dropped: int = 0  # QoS 0 deliveries to subscribers too far behind (outbound.py)


class BrokerRegistry:
    """One :class:`MqttBroker` per namespace, loaded from storage on first use."""

    def __init__(self, processor: Processor, peers: Peers | None = None) -> None:
        self._processor = processor
        self._peers = peers
        self._brokers: dict[str, MqttBroker] = {}
        self._loading: dict[str, asyncio.Future[MqttBroker]] = {}

    async def get(self, namespace: str) -> MqttBroker:
        broker = self._brokers.get(namespace)
        if broker is not None:
            return broker
        pending = self._loading.get(namespace)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[MqttBroker] = asyncio.get_running_loop().create_future()
        self._loading[namespace] = future
        try:
            broker = await MqttBroker.load(self._processor, namespace, self._peers)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._loading[namespace]
        self._brokers[namespace] = broker
        future.set_result(broker)
        return broker

    def loaded(self) -> list[MqttBroker]:
        return list(self._brokers.values())

    async def close(self) -> None:
        """Stop the brokers' background work (the last listener's stop): a start after
        it loads them again."""
        brokers = list(self._brokers.values())
        self._brokers.clear()
        for broker in brokers:
            await broker.close()


@dataclass(slots=True, kw_only=True)
class MqttServices:
    processor: Processor
    accounts: Accounts
    metering: Metering
    connections: ConnectionRegistry
    config: MqttConfig
    # What any peer may take (handshake and frame deadlines, packet sizes before and
    # after login) and the gateway's budget for packets still being read.
    limits: LimitsConfig
    frame_budget: FrameBudget
    clock: Clock
    brokers: BrokerRegistry
    stats: Stats
    options: MqttOptions
    version: str = "polymq"
    quotas: Quotas = field(default_factory=Quotas)  # per-account rates (docs/quotas.md)
    # Several gateways: the namespaces whose brokers load at start, not at a first
    # client's CONNECT (see :meth:`_load_brokers`).
    namespaces: tuple[str, ...] = ()
    # Every connection's keep-alive and every new TCP connection's handshake
    # deadline, on one timer (protocols/mqtt/deadlines.py).
    deadlines: Deadlines = field(default_factory=Deadlines)
    _sys_task: asyncio.Task[None] | None = None
    _loader: asyncio.Task[None] | None = None
    _listeners: int = 0  # started and not yet stopped

    def start(self) -> None:
        """Start publishing ``$SYS`` every ``options.sys_interval_s`` (idempotent: both
        listeners call it)."""
        self._listeners += 1
        if self._sys_task is None or self._sys_task.done():
            self._sys_task = asyncio.get_running_loop().create_task(self._publish_sys())
        if self.namespaces and (self._loader is None or self._loader.done()):
            self._loader = asyncio.get_running_loop().create_task(self._load_brokers())

    async def _load_brokers(self) -> None:
        """Load the configured namespaces' brokers now, retrying while storage does
        not answer. With several gateways, the copies into session queues of what
        reaches a storage topic from elsewhere (other protocols' messages, publishes
        stored owing copies while a queue's node or shard was away) are made by one
        gateway, chosen by the topic's hash among every gateway serving MQTT; one
        whose broker was not loaded (no MQTT client had connected to it since it
        started) followed no topic, so those copies were made by nobody, and the
        other gateways' tails moved past them: acknowledged publishes never reached
        the persistent sessions (the replicated chaos run, after a gateway restart)."""
        pause_s = 0.1
        waiting = list(self.namespaces)
        while waiting:
            namespace = waiting[0]
            try:
                await self.brokers.get(namespace)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # storage away (retried), or a namespace it refuses
                log.info("mqtt: the broker of %s loads later: %s", namespace, e)
                await asyncio.sleep(pause_s)
                pause_s = min(2.0, pause_s * 2)
                continue
            waiting.pop(0)
            pause_s = 0.1

    async def stop(self) -> None:
        """Stop ``$SYS`` and the brokers once no listener serves them: the TCP and the
        WebSocket listener share them, and the one stopping first still has its
        connections' sessions to end."""
        self._listeners = max(0, self._listeners - 1)
        if self._listeners > 0:
            return
        for task in (self._sys_task, self._loader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sys_task = self._loader = None
        await self.brokers.close()

    async def _publish_sys(self) -> None:
        while True:
            await asyncio.sleep(self.options.sys_interval_s)
            now = self.clock.now_ms()
            values = self.sys_values()
            for broker in self.brokers.loaded():
                for topic, value in values.items():
                    broker.deliver_transient(topic, Message(body=value, born_timestamp_ms=now))

    def sys_values(self) -> dict[str, bytes]:
        """The ``$SYS/broker/...`` topics and their current values (Mosquitto's
        names)."""
        brokers = self.brokers.loaded()
        uptime_s = (self.clock.now_ms() - self.stats.started_ms) // 1000
        received = sum(b.messages_in for b in brokers)
        return {
            "$SYS/broker/version": self.version.encode(),
            "$SYS/broker/uptime": f"{uptime_s} seconds".encode(),
            "$SYS/broker/clients/connected": str(self.stats.connected).encode(),
            "$SYS/broker/messages/received": str(received).encode(),
            "$SYS/broker/messages/sent": str(self.stats.sent).encode(),
            "$SYS/broker/publish/messages/dropped": str(self.stats.dropped).encode(),
            "$SYS/broker/subscriptions/count": str(sum(len(b.index) for b in brokers)).encode(),
        }

    def sys_topics(self, topic_filter: str, subscription_id: int | None) -> list[Delivery]:
        """Current ``$SYS`` values matching a new subscription, sent as retained."""
        if not topic_filter.startswith("$SYS"):
            return []
        now = self.clock.now_ms()
        return [
            Delivery(
                message=Message(body=value, born_timestamp_ms=now),
                topic=topic,
                qos=0,
                retain=True,
                subscription_ids=[subscription_id] if subscription_id else [],
            )
            for topic, value in self.sys_values().items()
            if filter_matches(topic_filter, topic)
        ]


_SHARED: weakref.WeakKeyDictionary[Processor, MqttServices] = weakref.WeakKeyDictionary()


def services_for(context: ListenerContext, options: MqttOptions | None = None) -> MqttServices:
    """The services shared by the MQTT listeners of one gateway (keyed by its
    processor, which both listeners' contexts carry); the first listener built
    sets the options."""
    services = _SHARED.get(context.processor)
    if services is None:
        services = MqttServices(
            processor=context.processor,
            accounts=context.accounts,
            metering=context.metering,
            connections=context.connections,
            config=context.config.mqtt,
            limits=context.config.limits,
            frame_budget=context.frame_budget,
            clock=context.clock,
            brokers=BrokerRegistry(context.processor, _peers(context)),
            namespaces=_eager_namespaces(context),
            quotas=context.quotas,
            stats=Stats(started_ms=context.clock.now_ms()),
            options=options
            or MqttOptions(
                max_keep_alive_s=context.config.mqtt.max_keep_alive_s,
                sys_interval_s=context.config.mqtt.sys_interval_s,
            ),
        )
        _SHARED[context.processor] = services
    return services


def serving(processor: Processor) -> MqttServices | None:
    """The MQTT services of the gateway with this processor, if it serves MQTT."""
    return _SHARED.get(processor)


def _eager_namespaces(context: ListenerContext) -> tuple[str, ...]:
    """Several gateways: the configured namespaces and every account's, whose brokers
    load at start (:meth:`MqttServices._load_brokers`); the merged form: none."""
    if isinstance(context.directory, SingleGateway):
        return ()
    return tuple(sorted(set(context.config.server.namespaces) | context.accounts.namespaces()))


def _peers(context: ListenerContext) -> Peers | None:
    """Other gateways may serve the same namespaces unless this is the merged form's
    only gateway."""
    if isinstance(context.directory, SingleGateway):
        return None
    gateway_id = context.config.cluster.gateway_id or context.directory.self_id
    return Peers(self_id=gateway_id, directory=context.directory)
