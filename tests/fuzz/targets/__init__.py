"""The fuzz targets: one module per codec, each with ``one_input(data: bytes) -> None``.

A target returns normally for input the codec accepts or refuses with one of its own
documented errors, and raises (or aborts, hangs, bloats) for anything else.

What atheris instruments for coverage is said here, not in the target modules: the
worker must know it before it imports a target, since only modules imported inside
``atheris.instrument_imports`` are instrumented (and atheris takes top-level packages).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["TARGETS", "Target"]


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    instrument: tuple[str, ...]  # top-level packages giving coverage (ours: polymq)
    max_len: int  # libFuzzer's -max_len: the largest input it makes


def _targets(*targets: Target) -> Mapping[str, Target]:
    return MappingProxyType({target.name: target for target in targets})


TARGETS: Mapping[str, Target] = _targets(
    Target("kafka_request", ("polymq", "kio"), 4096),
    Target("kafka_records", ("polymq",), 8192),
    Target("amqp_frames", ("polymq", "pamqp"), 8192),
    Target("mqtt311", ("polymq",), 4096),
    Target("mqtt5", ("polymq",), 4096),
    Target("mns_request", ("polymq", "xml"), 8192),
    Target("http_json", ("polymq", "json"), 8192),
    Target("rocketmq_mapping", ("polymq", "google"), 4096),
    Target("sql92", ("polymq",), 4096),
    Target("storage_rpc", ("polymq", "msgpack"), 8192),
    Target("grpc_frames", ("polymq", "hpack"), 8192),
)
