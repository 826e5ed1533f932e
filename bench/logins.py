"""What a password login costs (docs/security.md): one argon2id check at the default
cost, a login the cache of successes answers, and how much the event loop stalls
while several logins hash at once (they run in worker threads, at most two at a
time). In-process, on ``Accounts`` itself: no sockets, so the figures are the check's
own, not a protocol's.

    .venv/bin/python -m bench.logins [--checks 10] [--cached 10000] [--concurrent 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from polymq.gateway.accounts import Accounts
from polymq.gateway.config import AccountConfig, AuthConfig
from polymq.gateway.credentials import hash_password, verify_password

_PASSWORD = "bench-password"


def _accounts(password_hash: str) -> Accounts:
    account = AccountConfig(user="u", password_hash=password_hash)
    return Accounts(AuthConfig(mode="accounts", accounts=(account,)))


async def _loop_lag_during(logins: int, password_hash: str) -> tuple[float, list[float]]:
    """Seconds for ``logins`` uncached logins at once, and the loop's lateness on a
    1 ms timer meanwhile."""
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    task = asyncio.create_task(ticker())
    accounts = _accounts(password_hash)  # a fresh cache: every login hashes
    start = time.perf_counter()
    await asyncio.gather(
        *(accounts.authenticate("u", _PASSWORD, protocol="bench") for _ in range(logins))
    )
    elapsed = time.perf_counter() - start
    task.cancel()
    return elapsed, lags


async def main(args: argparse.Namespace) -> None:
    password_hash = hash_password(_PASSWORD)
    checks = []
    for _ in range(args.checks):
        start = time.perf_counter()
        verify_password(password_hash, _PASSWORD)
        checks.append(time.perf_counter() - start)
    print(
        f"argon2id check (m=64 MiB, t=3, p=4): median {statistics.median(checks) * 1000:.0f} ms"
        f" over {args.checks}"
    )
    accounts = _accounts(password_hash)
    await accounts.authenticate("u", _PASSWORD, protocol="bench")
    start = time.perf_counter()
    for _ in range(args.cached):
        await accounts.authenticate("u", _PASSWORD, protocol="bench")
    each = (time.perf_counter() - start) / args.cached
    print(f"cached login: {each * 1e6:.1f} µs each over {args.cached}")
    elapsed, lags = await _loop_lag_during(args.concurrent, password_hash)
    print(
        f"{args.concurrent} uncached logins at once: {elapsed * 1000:.0f} ms in all;"
        f" event-loop lateness median {statistics.median(lags) * 1000:.2f} ms,"
        f" max {max(lags) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=10)
    parser.add_argument("--cached", type=int, default=10_000)
    parser.add_argument("--concurrent", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
