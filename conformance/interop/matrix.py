"""The 5 x 5 matrix: for each (producer, consumer) pair, one message with every checked
field goes in through the first protocol's client and is read back through the
second's, and what arrives is judged against :mod:`conformance.interop.expectations`.

Cells run one after another over one driver (one client connection) per protocol,
each on a topic of its own, so a cell cannot see another's message.
"""

from __future__ import annotations

import contextlib
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence

from polymq.conformance.interop.driver import Driver
from polymq.conformance.interop.expectations import PROTOCOLS, check
from polymq.conformance.interop.fields import standard_message
from polymq.conformance.results import CaseResult, Outcome

__all__ = ["DRIVERS", "NATURAL_DRIVERS", "cell_topic", "open_drivers", "run_cell", "run_matrix"]

CELL_TIMEOUT_S = 20.0


def _kafka(host: str, port: int) -> Driver:
    from polymq.conformance.interop.drive_kafka import KafkaDriver

    return KafkaDriver(host, port)


def _amqp(host: str, port: int) -> Driver:
    from polymq.conformance.interop.drive_amqp import AmqpDriver

    return AmqpDriver(host, port)


def _mqtt(host: str, port: int) -> Driver:
    from polymq.conformance.interop.drive_mqtt import MqttDriver

    return MqttDriver(host, port)


def _rocketmq(host: str, port: int) -> Driver:
    from polymq.conformance.interop.drive_rocketmq import RocketMQDriver

    return RocketMQDriver(host, port)


def _mns(host: str, port: int) -> Driver:
    from polymq.conformance.interop.drive_mns import MnsDriver

    return MnsDriver(host, port)


def _amqp_natural(host: str, port: int) -> Driver:
    from polymq.conformance.interop.drive_amqp import AmqpNaturalDriver

    return AmqpNaturalDriver(host, port)


def _mns_natural(host: str, port: int) -> Driver:
    from polymq.conformance.interop.drive_mns import MnsNaturalDriver

    return MnsNaturalDriver(host, port)


# Imported on first use: a run over some protocols needs only their clients.
DRIVERS: Mapping[str, Callable[[str, int], Driver]] = {
    "kafka": _kafka,
    "amqp": _amqp,
    "mqtt": _mqtt,
    "rocketmq": _rocketmq,
    "mns": _mns,
}

# Natural names only (docs/interop.md): every client uses what its application would,
# no polymq-specific argument (Kafka, MQTT and RocketMQ name the topic already).
NATURAL_DRIVERS: Mapping[str, Callable[[str, int], Driver]] = {
    **DRIVERS,
    "amqp": _amqp_natural,
    "mns": _mns_natural,
}


def cell_topic(run_id: str, producer: str, consumer: str) -> str:
    """A name every protocol can address: letters, digits and dashes only (MNS queue
    and Kafka topic rules), unique per run and cell."""
    return f"ix-{run_id}-{producer}-{consumer}"


def run_cell(
    producer: Driver, consumer: Driver, topic: str, timeout_s: float = CELL_TIMEOUT_S
) -> CaseResult:
    """One cell: PASS when every field arrives as the expectations say, FAIL when a
    field differs or nothing arrives, ERROR when a client could not do its part."""
    feature = f"{producer.protocol} -> {consumer.protocol}"
    client = f"{producer.client} -> {consumer.client}"
    sent = standard_message(f"{producer.protocol}-{consumer.protocol}")
    started = time.monotonic()

    def result(outcome: Outcome, detail: str) -> CaseResult:
        seconds = round(time.monotonic() - started, 3)
        return CaseResult("interop", feature, client, outcome, seconds, detail)

    try:
        consumer.prepare(topic)
        producer.produce(topic, sent)
        arrived = consumer.consume(topic, timeout_s)
    except TimeoutError as e:
        return result(Outcome.FAIL, str(e))
    except Exception as e:
        last = traceback.format_exception_only(e)[-1].strip()
        return result(Outcome.ERROR, last)
    problems = check(arrived, sent, producer.protocol, consumer.protocol)
    return result(Outcome.FAIL if problems else Outcome.PASS, "; ".join(problems))


@contextlib.contextmanager
def open_drivers(
    host: str,
    ports: Mapping[str, int],
    protocols: Sequence[str] = PROTOCOLS,
    *,
    natural: bool = False,
) -> Iterator[dict[str, Driver | Exception]]:
    """One connected driver per protocol (or the error that kept it from starting),
    closed on exit; ``natural``: the drivers of :data:`NATURAL_DRIVERS`."""
    drivers: dict[str, Driver | Exception] = {}
    table = NATURAL_DRIVERS if natural else DRIVERS
    try:
        for protocol in protocols:
            try:
                drivers[protocol] = table[protocol](host, ports[protocol])
            except Exception as e:
                drivers[protocol] = e
        yield drivers
    finally:
        for driver in drivers.values():
            if not isinstance(driver, Exception):
                with contextlib.suppress(Exception):
                    driver.close()


def run_matrix(
    target_host: str,
    ports: Mapping[str, int],
    *,
    protocols: Sequence[str] = PROTOCOLS,
    timeout_s: float = CELL_TIMEOUT_S,
    run_id: str | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
    natural: bool = False,
) -> list[CaseResult]:
    """Every (producer, consumer) cell over ``protocols``, in order. ``ports`` maps
    protocol names (``mns`` for the HTTP API) to ports; the target must allow
    anonymous access (open auth mode). ``natural``: with natural names only."""
    run_id = run_id or uuid.uuid4().hex[:8]
    results: list[CaseResult] = []
    with open_drivers(target_host, ports, protocols, natural=natural) as drivers:
        for producer in protocols:
            for consumer in protocols:
                made, used = drivers[producer], drivers[consumer]
                if isinstance(made, Exception) or isinstance(used, Exception):
                    failed = made if isinstance(made, Exception) else used
                    cell = CaseResult(
                        "interop",
                        f"{producer} -> {consumer}",
                        "",
                        Outcome.ERROR,
                        0.0,
                        f"client did not start: {failed!r}",
                    )
                else:
                    topic = cell_topic(run_id, producer, consumer)
                    cell = run_cell(made, used, topic, timeout_s)
                results.append(cell)
                if on_result is not None:
                    on_result(cell)
    return results
