"""Certificates for tests (generated with ``cryptography``) and a secured etcd: TLS with client
certificates, authentication on, a root user and per-job users limited to their prefix."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from elasticrun.cli.etcd_users import add_job_user
from elasticrun.store.admin import enable_auth
from elasticrun.store.server import EtcdCluster, EtcdServer, HealthTLS, ServerTLS
from elasticrun.store.settings import EtcdSettings

ROOT_PASSWORD = "root-Secret-7f3a"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _sign(subject: str, key, issuer: x509.Name, ca_key, *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                         x509.DNSName("localhost")]), critical=False)
    if not ca:
        usage = [x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return b.sign(ca_key, hashes.SHA256())


@dataclass
class Certs:
    """A CA, a server certificate for 127.0.0.1 and client certificates, as PEM files in ``dir``."""

    dir: Path
    ca: Path = field(init=False)
    server: Tuple[Path, Path] = field(init=False)
    clients: Dict[str, Tuple[Path, Path]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca_name = _name("elasticrun test CA")
        ca_cert = _sign("elasticrun test CA", self._ca_key, self._ca_name, self._ca_key, ca=True)
        self.ca = self.dir / "ca.crt"
        self.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        self.server = self._issue("server", server=True)

    def _issue(self, cn: str, server: bool = False) -> Tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _sign(cn, key, self._ca_name, self._ca_key, server=server)
        crt, kp = self.dir / f"{cn}.crt", self.dir / f"{cn}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, kp)
        return crt, kp

    def client(self, cn: str) -> Tuple[Path, Path]:
        """A client certificate (and key) with common name ``cn``."""
        if cn not in self.clients:
            self.clients[cn] = self._issue(cn)
        return self.clients[cn]


@dataclass
class SecureEtcd:
    """A running etcd with client-certificate TLS and authentication on."""

    server: EtcdServer
    certs: Certs
    passwords: Dict[str, str] = field(default_factory=dict)
    endpoints: str = ""  # every member's endpoint, for a cluster (default: the server's)

    def settings(self, user: str = "", password_file: str = "", client: str = "elasticrun-client") -> EtcdSettings:
        """Connection settings for ``user`` (its password from ``password_file`` when given)."""
        crt, key = self.certs.client(client)
        return EtcdSettings(
            self.endpoints or self.server.endpoint, ca_cert=str(self.certs.ca), cert=str(crt), key=str(key),
            user=user or None,
            password=None if password_file or not user else self.passwords[user],
            password_file=password_file or None, retry_timeout=10.0,
        )

    def add_job_user(self, job_id: str, password: str) -> None:
        with self.settings("root").connect() as root:
            add_job_user(root, job_id, password, job_id)
        self.passwords[job_id] = password

    def restart(self) -> None:
        self.server.kill()
        self.server.restart()


def start_secure_etcd(dir: Path, token_ttl: int) -> SecureEtcd:
    """Start etcd with TLS (client certificates required), then turn authentication on."""
    certs = Certs(dir)
    crt, key = certs.server
    admin_crt, admin_key = certs.client("elasticrun-client")
    server = EtcdServer(
        tls=ServerTLS(str(crt), str(key), client_ca=str(certs.ca)),
        health_tls=HealthTLS(str(certs.ca), str(admin_crt), str(admin_key)),
        auth_token_ttl=token_ttl,
    ).start()
    secure = SecureEtcd(server, certs, {"root": ROOT_PASSWORD})
    try:
        with secure.settings().connect() as store:
            enable_auth(store, ROOT_PASSWORD)
    except BaseException:
        server.stop()
        raise
    return secure


def start_secure_cluster(dir: Path, size: int = 3) -> Tuple[EtcdCluster, SecureEtcd]:
    """A ``size``-member etcd cluster with TLS (client certificates required) and authentication on."""
    certs = Certs(dir)
    crt, key = certs.server
    admin_crt, admin_key = certs.client("elasticrun-client")
    cluster = EtcdCluster(size, tls=ServerTLS(str(crt), str(key), client_ca=str(certs.ca)),
                          health_tls=HealthTLS(str(certs.ca), str(admin_crt), str(admin_key))).start()
    secure = SecureEtcd(next(iter(cluster.members.values())), certs, {"root": ROOT_PASSWORD},
                        endpoints=cluster.endpoints)
    try:
        with secure.settings().connect() as store:
            enable_auth(store, ROOT_PASSWORD)
    except BaseException:
        cluster.stop()
        raise
    return cluster, secure


__all__ = ["Certs", "ROOT_PASSWORD", "SecureEtcd", "start_secure_cluster", "start_secure_etcd"]
