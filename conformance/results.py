"""The one shape every conformance result takes, shared by the protocol cases, the
interoperability matrix (``conformance/interop``) and the reports.

A result says what a target did, not what polymq's code intends: ``outcome`` is judged
against the protocol's specification and the reference brokers' behaviour. Interop
cells use ``protocol="interop"`` and ``feature="<producer> -> <consumer>"``.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["CaseResult", "Outcome"]


class Outcome(enum.StrEnum):
    """How a case ended.

    ``UNSUPPORTED`` is a case the target is known not to offer (a reference broker
    without MQTT QoS 2, say): reported apart from ``FAIL`` so the table tells a missing
    feature from a broken one. ``ERROR`` is a case that could not judge the target at
    all (client crashed, timed out before any assertion, connection refused)."""

    PASS = "pass"
    FAIL = "fail"
    UNSUPPORTED = "skip-unsupported"
    ERROR = "error"


@dataclasses.dataclass(frozen=True, slots=True)
class CaseResult:
    """One row of the table: a feature of one protocol, exercised by one client."""

    protocol: str
    feature: str
    client: str
    outcome: Outcome
    seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True when this row does not count against the target."""
        return self.outcome in (Outcome.PASS, Outcome.UNSUPPORTED)
