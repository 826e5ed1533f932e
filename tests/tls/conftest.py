"""Certificates made in the test (trustme) and a gateway serving TLS with them.

One CA signs the server's certificate (for 127.0.0.1 and localhost) and the client
certificates whose CN names an account (mutual TLS, ``principal_from = "cn"``);
another CA, which the server does not trust, signs a stranger's. Client certificates
are optional on the server (``verify = "optional"``), so password logins over TLS work
beside certificate logins, and a certificate that fails verification is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from polymq.gateway.config import AccountConfig, AuthConfig
from tests.live_server import LiveServer, live_server, server_config

NAMESPACE = "tls-ns"
USER, PASSWORD = "alice", "alice-secret"
ACCESS_KEY, SECRET_KEY = "AKALICE", "SKALICE"  # RocketMQ and MNS sign with these


@dataclass(frozen=True)
class Certs:
    """PEM files: the CA clients trust (``ca``), the server's chain and key, a client
    certificate naming ``alice``, an expired one, and one from an untrusted CA."""

    folder: Path
    ca: Path
    server_chain: Path
    server_key: Path
    client_chain: Path
    client_key: Path
    expired_chain: Path
    expired_key: Path
    stranger_chain: Path
    stranger_key: Path
    other_ca: Path
    authority: trustme.CA


def write_cert(folder: Path, name: str, cert: trustme.LeafCert) -> tuple[Path, Path]:
    chain, key = folder / f"{name}.pem", folder / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(chain))
    for blob in cert.cert_chain_pems[1:]:
        blob.write_to_path(str(chain), append=True)
    cert.private_key_pem.write_to_path(str(key))
    return chain, key


def make_certs(folder: Path) -> Certs:
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    other.cert_pem.write_to_path(str(folder / "other-ca.pem"))
    server = write_cert(folder, "server", ca.issue_cert("127.0.0.1", "localhost"))
    client = write_cert(folder, "client", ca.issue_cert("alice@clients", common_name=USER))
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    expired = write_cert(
        folder,
        "expired",
        ca.issue_cert(
            "alice@clients",
            common_name=USER,
            not_before=past,
            not_after=past + datetime.timedelta(days=1),
        ),
    )
    stranger = write_cert(folder, "stranger", other.issue_cert("mallory", common_name=USER))
    return Certs(
        folder=folder,
        ca=folder / "ca.pem",
        server_chain=server[0],
        server_key=server[1],
        client_chain=client[0],
        client_key=client[1],
        expired_chain=expired[0],
        expired_key=expired[1],
        stranger_chain=stranger[0],
        stranger_key=stranger[1],
        other_ca=folder / "other-ca.pem",
        authority=ca,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_overrides(certs: Certs) -> dict[str, str]:
    """[tls] as dotted keys: the server certificate, client certificates checked
    against the CA when sent, their CN naming the account."""
    return {
        "tls.cert_file": str(certs.server_chain),
        "tls.key_file": str(certs.server_key),
        "tls.ca_file": str(certs.ca),
        "tls.verify": "optional",
        "tls.principal_from": "cn",
    }


ACCOUNTS = AuthConfig(
    mode="accounts",
    accounts=(
        AccountConfig(
            user=USER,
            password=PASSWORD,
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            namespaces=(NAMESPACE,),
        ),
    ),
)


@contextmanager
def tls_server(
    data_dir: Path, certs: Certs, listeners: tuple[str, ...], **overrides: str
) -> Iterator[LiveServer]:
    """A gateway (in the module's form) serving ``listeners`` with [tls] from
    ``certs`` and the one account."""
    settings = {**tls_overrides(certs), **overrides}
    config = dataclasses.replace(server_config(data_dir, listeners, settings), auth=ACCOUNTS)
    with live_server(data_dir, listeners, config=config) as server:
        yield server
