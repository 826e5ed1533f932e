"""Alibaba MNS-style queues and topics over HTTP (served by :mod:`protocols.http`)."""

from polymq.protocols.mns.routes import MnsApi

__all__ = ["MnsApi"]
