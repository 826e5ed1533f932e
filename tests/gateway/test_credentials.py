"""Stored credentials (docs/security.md): argon2id hashes and RFC 5803 SCRAM keys in the
config, checked at load; Accounts.authenticate off the loop with its cache of
successes; the per-address slowdown of failed logins computed on a manual clock; and
what `polymq passwd` prints logs in."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import threading
from pathlib import Path

import argon2
import pytest
from scramp import ScramMechanism

from polymq.gateway.accounts import Accounts, AuthenticationFailed
from polymq.gateway.cli import build_parser
from polymq.gateway.config import AccountConfig, AuthConfig, ConfigError, load_config
from polymq.gateway.credentials import (
    CredentialError,
    ScramKeys,
    StoredCredentials,
    check_password_hash,
    hash_password,
    verify_password,
)
from polymq.gateway.login_guard import LoginGuard, LoginGuardConfig
from polymq.gateway.passwd import credential_lines, read_password
from polymq.gateway.verified_cache import VerifiedCache
from polymq.storage.clock import ManualClock

SECRET = "correct horse battery staple"
# A cheap argon2id hash keeps the tests fast; the format is the standard one.
CHEAP = argon2.PasswordHasher(time_cost=1, memory_cost=8192, parallelism=1)
HASH = CHEAP.hash(SECRET)
SCRAM_256 = ScramKeys.derive("SCRAM-SHA-256", SECRET).format()
SCRAM_512 = ScramKeys.derive("SCRAM-SHA-512", SECRET).format()


def _accounts(*accounts: AccountConfig, clock: ManualClock | None = None) -> Accounts:
    return Accounts(AuthConfig(mode="accounts", accounts=accounts), clock=clock)


def _load(tmp_path: Path, account_lines: str) -> AuthConfig:
    path = tmp_path / "polymq.toml"
    path.write_text(f'[auth]\nmode = "accounts"\n[[auth.accounts]]\nuser = "u"\n{account_lines}')
    return load_config(path, {}).auth


# -- formats ---------------------------------------------------------------------------


def test_scram_keys_round_trip_and_agree_with_scramp() -> None:
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        keys = ScramKeys.derive(mechanism, SECRET, salt=b"0123456789abcdef", iterations=8192)
        assert ScramKeys.parse(mechanism, keys.format()) == keys
        salt, stored, server, _ = ScramMechanism(mechanism).make_auth_info(
            SECRET, iteration_count=8192, salt=b"0123456789abcdef"
        )
        assert (bytes(salt), stored, server) == (keys.salt, keys.stored_key, keys.server_key)
        assert keys.format().startswith(f"{mechanism}$8192:")
        assert keys.matches(SECRET)
        assert not keys.matches(SECRET + "x")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "SCRAM-SHA-512$4096:AAAA$AAAA:AAAA",  # the other mechanism's name
        "SCRAM-SHA-256$4096:c2FsdHNhbHRzYWx0$AAAA",  # no ServerKey
        "SCRAM-SHA-256$many:c2FsdHNhbHRzYWx0$AAAA:AAAA",
        "SCRAM-SHA-256$1024:c2FsdHNhbHRzYWx0$" + "A" * 44 + ":" + "A" * 44,  # too few rounds
        "SCRAM-SHA-256$4096:c2FsdA==$" + "A" * 44 + ":" + "A" * 44,  # 4-byte salt
        "SCRAM-SHA-256$4096:c2FsdHNhbHRzYWx0$AAAA:AAAA",  # keys of the wrong size
        "SCRAM-SHA-256$4096:!!!$" + "A" * 44 + ":" + "A" * 44,
    ],
)
def test_scram_keys_refuse_malformed(text: str) -> None:
    with pytest.raises(CredentialError):
        ScramKeys.parse("SCRAM-SHA-256", text)


def test_password_hash_checks() -> None:
    check_password_hash(HASH)
    check_password_hash(hash_password("x"))
    for bad in ("", "hunter2", "$argon2id$v=19$m=8,t=1", "$2b$12$abcdefghijklmnopqrstuv"):
        with pytest.raises(CredentialError, match="argon2id PHC"):
            check_password_hash(bad)
    argon2i = argon2.PasswordHasher(
        time_cost=1, memory_cost=8192, parallelism=1, type=argon2.Type.I
    ).hash("x")
    with pytest.raises(CredentialError, match="argon2i is not accepted"):
        check_password_hash(argon2i)
    assert verify_password(HASH, SECRET)
    assert not verify_password(HASH, SECRET.upper())
    assert not verify_password("garbage", SECRET)


def test_config_takes_hashes_and_refuses_bad_ones_clearly(tmp_path: Path) -> None:
    auth = _load(
        tmp_path,
        f'password_hash = "{HASH}"\nscram_sha_256 = "{SCRAM_256}"\nscram_sha_512 = "{SCRAM_512}"\n',
    )
    account = auth.accounts[0]
    assert (account.password_hash, account.scram_sha_256, account.password) == (
        HASH,
        SCRAM_256,
        None,
    )
    broken = HASH.replace("m=8192,", "")  # its memory cost left out
    with pytest.raises(ConfigError, match=r"'password_hash' of user 'u': not an argon2id") as e:
        _load(tmp_path, f'password_hash = "{broken}"\n')
    assert broken not in str(e.value)  # the message never echoes a credential
    with pytest.raises(ConfigError, match=r"'scram_sha_512' of user 'u': expected SCRAM-SHA-512"):
        _load(tmp_path, f'scram_sha_512 = "{SCRAM_256}"\n')
    with pytest.raises(ConfigError, match="'password_hash' or \\(for trials\\) 'password'"):
        _load(tmp_path, f'password = "x"\npassword_hash = "{HASH}"\n')
    with pytest.raises(ConfigError, match="neither a password"):
        _load(tmp_path, "")


# -- Accounts --------------------------------------------------------------------------


async def test_a_hash_logs_in_and_a_wrong_password_does_not() -> None:
    accounts = _accounts(AccountConfig(user="alice", password_hash=HASH))
    principal = await accounts.authenticate("alice", SECRET, protocol="test")
    assert principal.name == "alice"
    for user, password in [("alice", "wrong"), ("alice", None), ("bob", SECRET), (None, None)]:
        with pytest.raises(AuthenticationFailed, match=r"^bad user name or password$"):
            await accounts.authenticate(user, password, protocol="test")
    # A hash gives SCRAM nothing to work with.
    assert accounts.scram_keys("alice", "SCRAM-SHA-256") is None


async def test_an_unknown_user_is_hashed_at_the_configured_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unknown users cost a check of the same cost as a known one, so the answer's
    timing does not tell user names apart."""
    import polymq.gateway.accounts as accounts_module

    checked: list[str] = []

    def recording(password_hash: str, password: str) -> bool:
        checked.append(password_hash)
        return verify_password(password_hash, password)

    monkeypatch.setattr(accounts_module, "verify_password", recording)
    accounts = _accounts(AccountConfig(user="alice", password_hash=HASH))
    with pytest.raises(AuthenticationFailed):
        await accounts.authenticate("mallory", SECRET, protocol="test")
    assert len(checked) == 1 and checked[0] != HASH
    assert argon2.extract_parameters(checked[0]) == argon2.extract_parameters(HASH)


def test_scram_decoys_keep_a_salt_per_user_name() -> None:
    """An unknown user's SCRAM exchange runs on decoy keys whose salt is as stable as a
    real account's, so asking twice does not tell unknown names from known ones."""
    accounts = _accounts(AccountConfig(user="alice", password_hash=HASH))
    first = accounts.scram_decoy("nobody", "SCRAM-SHA-512")
    again = accounts.scram_decoy("nobody", "SCRAM-SHA-512")
    assert first.salt == again.salt and len(first.salt) == 16
    assert accounts.scram_decoy("somebody", "SCRAM-SHA-512").salt != first.salt
    assert len(first.stored_key) == len(first.server_key) == 64
    assert first.stored_key != again.stored_key  # nothing any password derives


async def test_scram_keys_alone_verify_plain_passwords_too() -> None:
    accounts = _accounts(AccountConfig(user="s", scram_sha_512=SCRAM_512))
    assert (await accounts.authenticate("s", SECRET, protocol="test")).name == "s"
    with pytest.raises(AuthenticationFailed):
        await accounts.authenticate("s", "nope", protocol="test")
    assert accounts.scram_keys("s", "SCRAM-SHA-512") == ScramKeys.parse("SCRAM-SHA-512", SCRAM_512)
    assert accounts.scram_keys("s", "SCRAM-SHA-256") is None


async def test_a_clear_trial_password_still_works_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="polymq.gateway.accounts"):
        accounts = _accounts(AccountConfig(user="t", password="trial"))
    assert "'t': its password is stored in clear" in caplog.text
    assert "trial" not in caplog.text.replace("a trial", "")  # the password itself is not
    assert (await accounts.authenticate("t", "trial", protocol="test")).name == "t"
    keys = accounts.scram_keys("t", "SCRAM-SHA-256")  # derived, so trials can use SCRAM
    assert keys is not None and keys.matches("trial")


async def test_verification_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop keeps turning while a (real-cost) argon2id check runs."""
    accounts = _accounts(AccountConfig(user="slow", password_hash=hash_password(SECRET)))
    threads: list[str] = []
    original = accounts._verify

    def spy(credentials: StoredCredentials | None, password: str | None) -> bool:
        threads.append(threading.current_thread().name)
        return original(credentials, password)

    monkeypatch.setattr(accounts, "_verify", spy)
    ticks = 0
    login = asyncio.create_task(accounts.authenticate("slow", SECRET, protocol="test"))
    while not login.done():
        ticks += 1
        await asyncio.sleep(0)
    await login
    assert threads and threads[0] != threading.main_thread().name
    assert ticks > 1


async def test_cache_admits_only_the_same_password_and_goes_with_the_config() -> None:
    accounts = _accounts(AccountConfig(user="alice", password_hash=HASH))
    await accounts.authenticate("alice", SECRET, protocol="test")
    assert len(accounts._verified) == 1
    await accounts.authenticate("alice", SECRET, protocol="test")  # a hit: no new entry
    assert len(accounts._verified) == 1
    with pytest.raises(AuthenticationFailed):  # a cached success never admits another
        await accounts.authenticate("alice", SECRET + " ", protocol="test")
    # A new config (the password changed): the old password no longer logs in.
    new_hash = CHEAP.hash("new password")
    accounts.reload(
        AuthConfig(mode="accounts", accounts=(AccountConfig(user="alice", password_hash=new_hash),))
    )
    assert len(accounts._verified) == 0
    with pytest.raises(AuthenticationFailed):
        await accounts.authenticate("alice", SECRET, protocol="test")
    assert (await accounts.authenticate("alice", "new password", protocol="test")).name == "alice"
    # Even an entry left behind names the credentials it was checked against: once
    # the account's credentials are other objects, it no longer admits anyone.
    accounts._load(
        AuthConfig(mode="accounts", accounts=(AccountConfig(user="alice", password_hash=HASH),))
    )
    assert len(accounts._verified) == 1
    with pytest.raises(AuthenticationFailed):
        await accounts.authenticate("alice", "new password", protocol="test")


def test_cache_entries_are_bounded_and_keyed() -> None:
    cache: VerifiedCache[str] = VerifiedCache(capacity=3)
    for i in range(5):
        cache.put(f"user{i}", "pw", f"v{i}")
    assert len(cache) == 3
    assert cache.get("user0", "pw") is None  # the least recent went first
    assert cache.get("user4", "pw") == "v4"
    assert cache.get("user4", "pw2") is None
    # Length-prefixed: user "a\0b" with "c" is not user "a" with "b\0c".
    cache.put("a\0b", "c", "x")
    assert cache.get("a", "b\0c") is None


# -- failed logins ---------------------------------------------------------------------


def test_the_guard_backs_off_per_address_and_forgets() -> None:
    clock = ManualClock()
    guard = LoginGuard(
        LoginGuardConfig(free_failures=2, first_delay_ms=100, max_delay_ms=1000), clock
    )

    def fail(peer: str = "10.0.0.1:5000") -> int:
        return guard.failed(protocol="kafka", user="eve", peer=peer)

    assert [fail() for _ in range(8)] == [0, 0, 100, 200, 400, 800, 1000, 1000]
    assert fail("10.0.0.1:6000") == 1000  # the port does not matter: the address does
    assert fail("10.0.0.2:5000") == 0  # another address has its own count
    guard.succeeded("10.0.0.1:7000")  # a success resets its address
    assert fail() == 0
    clock.advance(LoginGuardConfig().forget_after_ms + 1)
    assert [fail("10.0.0.2:1"), fail("10.0.0.2:1"), fail("10.0.0.2:1")] == [0, 0, 100]
    assert guard.failures() == {"kafka": 14}
    assert guard.delay_ms(10_000) == 1000  # no overflow on a long streak


def test_the_guard_tracks_a_bounded_number_of_addresses() -> None:
    guard = LoginGuard(LoginGuardConfig(max_addresses=100), ManualClock())
    for i in range(1000):
        guard.failed(protocol="mqtt", user="x", peer=f"10.0.{i // 256}.{i % 256}:1")
    assert guard.tracked_addresses() == 100


async def test_a_failure_waits_its_delay_on_the_clock_and_is_logged_without_the_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    accounts = Accounts(
        AuthConfig(
            mode="accounts",
            accounts=(AccountConfig(user="alice", password_hash=HASH),),
            login_failures_free=1,
            login_failure_delay_ms=250,
        ),
        clock=clock,
    )
    wrong = "Tr0ub4dor&3-wrong"
    with caplog.at_level(logging.WARNING, logger="polymq.gateway.login_guard"):
        with pytest.raises(AuthenticationFailed):  # the free one: answered at once
            await accounts.authenticate("alice", wrong, protocol="amqp", peer="10.1.2.3:4567")
        second = asyncio.create_task(
            accounts.authenticate("alice", wrong, protocol="amqp", peer="10.1.2.3:4568")
        )
        # The refusal waits on the clock: not answered before 250 ms pass on it.
        async with asyncio.timeout(30):
            while "2 in a row" not in caplog.text:
                await asyncio.sleep(0.01)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done()
        clock.advance(249)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not second.done()
        clock.advance(1)
        with pytest.raises(AuthenticationFailed):
            await asyncio.wait_for(second, 30)
    assert "protocol=amqp user='alice' peer=10.1.2.3:4567" in caplog.text
    assert "answered after 250 ms" in caplog.text
    assert wrong not in caplog.text
    assert accounts.login_failures() == {"amqp": 2}


# -- polymq passwd ---------------------------------------------------------------------


async def test_passwd_lines_paste_into_a_config_that_logs_in(tmp_path: Path) -> None:
    lines = credential_lines(SECRET)
    assert [line.split(" = ")[0] for line in lines] == [
        "password_hash",
        "scram_sha_256",
        "scram_sha_512",
    ]
    auth = _load(tmp_path, "\n".join(lines) + "\n")
    accounts = Accounts(auth)
    assert (await accounts.authenticate("u", SECRET, protocol="test")).name == "u"
    with pytest.raises(AuthenticationFailed):
        await accounts.authenticate("u", "not it", protocol="test")
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        keys = accounts.scram_keys("u", mechanism)
        assert keys is not None and keys.matches(SECRET)


def test_passwd_reads_stdin_and_never_takes_the_password_from_argv() -> None:
    assert read_password(from_stdin=True, stdin=io.StringIO("s3cret\nrest\n")) == "s3cret"
    with pytest.raises(ValueError, match="empty"):
        read_password(from_stdin=True, stdin=io.StringIO("\n"))
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        build_parser().parse_args(["passwd", "s3cret"])  # no positional password
