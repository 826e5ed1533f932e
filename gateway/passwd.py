"""``polymq passwd``: the stored credentials for a password, as TOML lines to paste into
an ``[[auth.accounts]]`` table (docs/security.md).

The password is read from a prompt (twice, without echo) or, with ``--stdin``, from the
first line of standard input, never from the command line, where it would end up in
the shell history and in every process listing.
"""

from __future__ import annotations

import getpass
import json
import sys
from typing import TextIO

from polymq.gateway.credentials import (
    DEFAULT_SCRAM_ITERATIONS,
    SCRAM_MECHANISMS,
    ScramKeys,
    hash_password,
)

__all__ = ["credential_lines", "read_password", "run"]


def credential_lines(password: str, *, iterations: int = DEFAULT_SCRAM_ITERATIONS) -> list[str]:
    """``password_hash``, ``scram_sha_256`` and ``scram_sha_512`` as TOML key/value
    lines (fresh salts each time)."""
    lines = [f"password_hash = {json.dumps(hash_password(password))}"]
    for mechanism in SCRAM_MECHANISMS:
        keys = ScramKeys.derive(mechanism, password, iterations=iterations)
        key = mechanism.lower().replace("-", "_")
        lines.append(f"{key} = {json.dumps(keys.format())}")
    return lines


def read_password(*, from_stdin: bool, stdin: TextIO) -> str:
    """The password from stdin's first line (its line ending dropped), or typed twice
    at a prompt. Raises ``ValueError`` when it is empty or the two differ."""
    if from_stdin:
        password = stdin.readline().rstrip("\r\n")
    else:
        password = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != password:
            raise ValueError("the passwords differ")
    if not password:
        raise ValueError("the password is empty")
    return password


def run(*, from_stdin: bool, iterations: int, user: str | None) -> int:
    try:
        password = read_password(from_stdin=from_stdin, stdin=sys.stdin)
    except ValueError as e:
        print(f"polymq passwd: {e}", file=sys.stderr)
        return 2
    except (EOFError, KeyboardInterrupt):
        print("polymq passwd: no password given", file=sys.stderr)
        return 2
    if user is not None:
        print("[[auth.accounts]]")
        print(f"user = {json.dumps(user)}")
    for line in credential_lines(password, iterations=iterations):
        print(line)
    return 0
