"""The cross-protocol interoperability matrix (issue 9): every pair of protocols, one
message with a body, a key, a tag, user properties and a content type, checked against
the mapping docs/interop.md writes down."""

from polymq.conformance.interop.matrix import run_matrix

__all__ = ["run_matrix"]
