"""The MNS-style HTTP API through httpx, as XML documents (the aliyun-mns-sdk 1.3.0
cannot send a queue message's MessageTag). MessageTag is the tag; the key and the
content type travel as user properties (``polymq.key``, ``content-type``). Bodies are
text; the correlation id and reply-to are user properties too (``correlation-id``,
``reply-to``). Requests are unsigned: the target must be in open auth mode."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from xml.sax.saxutils import escape

import httpx

from polymq.conformance.interop.driver import poll
from polymq.conformance.interop.fields import Arrived, Sent
from polymq.protocols import interop

__all__ = ["MnsDriver", "MnsNaturalDriver"]

_HEADERS = {"x-mns-version": "2015-06-06", "Content-Type": "text/xml;charset=UTF-8"}
_NS = "{http://mns.aliyuncs.com/doc/v1/}"


def _text(element: ET.Element, name: str) -> str | None:
    found = element.find(_NS + name)
    if found is None:
        found = element.find(name)
    return found.text if found is not None else None


def _children(element: ET.Element, name: str) -> list[ET.Element]:
    return element.findall(_NS + name) + element.findall(name)


class MnsDriver:
    protocol = "mns"
    client = "httpx (MNS XML API)"

    def __init__(self, host: str, port: int) -> None:
        self._http = httpx.Client(base_url=f"http://{host}:{port}", headers=_HEADERS, timeout=30)

    def _create_queue(self, name: str) -> None:
        """CreateQueue; a queue (or another protocol's storage topic) already there
        is fine: MNS adopts the topic on first use."""
        response = self._http.put(f"/queues/{name}", content=b"<Queue/>")
        if response.status_code not in (201, 204, 409):
            raise RuntimeError(f"CreateQueue answered {response.status_code}: {response.text}")

    def prepare(self, topic: str) -> None:
        self._create_queue(topic)

    def produce(self, topic: str, sent: Sent) -> None:
        self._create_queue(topic)
        self._send(f"/queues/{topic}/messages", sent, "SendMessage")

    def _send(self, path: str, sent: Sent, what: str) -> None:
        props = [
            (interop.KEY, sent.key),
            (interop.CONTENT_TYPE, sent.content_type),
            (interop.CORRELATION_ID, sent.correlation_id),
            (interop.REPLY_TO, sent.reply_to),
            *sent.properties,
        ]
        values = "".join(
            f"<PropertyValue><Name>{escape(n)}</Name><Value>{escape(v)}</Value>"
            "<Type>STRING</Type></PropertyValue>"
            for n, v in props
        )
        document = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f'<Message xmlns="{_NS[1:-1]}">'
            f"<MessageBody>{escape(sent.body.decode())}</MessageBody>"
            f"<MessageTag>{escape(sent.tag)}</MessageTag>"
            f"<UserProperties>{values}</UserProperties></Message>"
        )
        response = self._http.post(path, content=document.encode())
        if response.status_code != 201:
            raise RuntimeError(f"{what} answered {response.status_code}: {response.text}")

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        return self._receive(topic, timeout_s)

    def _receive(self, queue: str, timeout_s: float) -> Arrived:
        def take(remaining: float) -> ET.Element | None:
            wait = max(1, min(int(remaining), 3))
            response = self._http.get(
                f"/queues/{queue}/messages", params={"waitseconds": wait}, timeout=wait + 30
            )
            if response.status_code == 404 and "MessageNotExist" in response.text:
                return None
            if response.status_code != 200:
                raise RuntimeError(f"ReceiveMessage answered {response.status_code}")
            return ET.fromstring(response.content)

        message = poll(take, timeout_s, "mns")
        receipt = _text(message, "ReceiptHandle") or ""
        self._http.delete(f"/queues/{queue}/messages", params={"ReceiptHandle": receipt})
        properties: dict[str, str] = {}
        for holder in _children(message, "UserProperties"):
            for value in _children(holder, "PropertyValue"):
                properties[_text(value, "Name") or ""] = _text(value, "Value") or ""
        key = properties.pop(interop.KEY, None)
        content_type = properties.pop(interop.CONTENT_TYPE, None)
        correlation_id = properties.pop(interop.CORRELATION_ID, None)
        reply_to = properties.pop(interop.REPLY_TO, None)
        return Arrived(
            body=(_text(message, "MessageBody") or "").encode(),
            key=key,
            tag=_text(message, "MessageTag"),
            properties=properties,
            content_type=content_type,
            correlation_id=correlation_id,
            reply_to=reply_to,
        )

    def close(self) -> None:
        self._http.close()


class MnsNaturalDriver(MnsDriver):
    """What an MNS application does with a topic (docs/interop.md, natural names): it
    publishes to MNS topic ``T`` (PublishMessage) and consumes a queue of its own
    subscribed to ``T`` (a queue endpoint, so the message itself arrives)."""

    client = "httpx (MNS XML API, topic and subscription)"

    def _create_topic(self, topic: str) -> None:
        response = self._http.put(f"/topics/{topic}", content=b"<Topic/>")
        if response.status_code not in (201, 204, 409):
            raise RuntimeError(f"CreateTopic answered {response.status_code}: {response.text}")

    def prepare(self, topic: str) -> None:
        self._create_topic(topic)
        queue = _subscribed_queue(topic)
        self._create_queue(queue)
        document = f"<Subscription><Endpoint>queues/{queue}</Endpoint></Subscription>"
        response = self._http.put(f"/topics/{topic}/subscriptions/app", content=document.encode())
        if response.status_code not in (201, 204, 409):
            raise RuntimeError(f"Subscribe answered {response.status_code}: {response.text}")

    def produce(self, topic: str, sent: Sent) -> None:
        self._create_topic(topic)
        self._send(f"/topics/{topic}/messages", sent, "PublishMessage")

    def consume(self, topic: str, timeout_s: float) -> Arrived:
        return self._receive(_subscribed_queue(topic), timeout_s)


def _subscribed_queue(topic: str) -> str:
    return f"{topic}-app"
