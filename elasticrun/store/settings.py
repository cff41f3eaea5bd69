"""How to reach one etcd cluster: endpoints, TLS files, user, where the password comes from, timeouts.

:class:`EtcdSettings` is a plain value: it knows no job. Every connection — the agent, the
workers, ``status``, ``ckpt save``, ``elasticrun etcd`` setting up users — is opened with
:meth:`EtcdSettings.connect`. How the settings travel from the flags to the agent and on to
its workers (the ``ELASTICRUN_ETCD_*`` names, the 0600 settings file) is the job's contract:
:mod:`elasticrun.job.settings`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from elasticrun.errors import ConfigError

if TYPE_CHECKING:
    from elasticrun.store.client import EtcdStore


@dataclass(frozen=True)
class EtcdSettings:
    """Connection settings for one etcd cluster (the password never shows in ``repr``).

    Exactly one password source is used: ``password`` (already resolved), else the file
    ``password_file``, else the environment variable named ``password_env``.
    """

    endpoints: str
    ca_cert: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    user: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    password_file: Optional[str] = None
    password_env: Optional[str] = None
    timeout: float = 5.0
    retry_timeout: float = 10.0

    def replace(self, **changes: Any) -> EtcdSettings:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def resolved(self) -> EtcdSettings:
        """A copy whose ``password`` is read from its source; ConfigError (one line) if it cannot be.

        A user without any password source, or a password without a user, is an error here,
        before any connection is tried.
        """
        password = self.password
        if password is None and self.password_file:
            password = read_password_file(self.password_file)
        if password is None and self.password_env:
            password = os.environ.get(self.password_env) or None
        if self.user and password is None:
            where = f"set {self.password_env} or pass" if self.password_env else "pass"
            raise ConfigError(f"etcd user {self.user!r} has no password: {where} --etcd-password-file FILE")
        if password is not None and not self.user:
            raise ConfigError("an etcd password was given without a user: also pass --etcd-user")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("TLS client authentication needs both --etcd-cert and --etcd-key")
        for path, flag in ((self.ca_cert, "--etcd-cacert"), (self.cert, "--etcd-cert"), (self.key, "--etcd-key")):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path!r}: no such file")
        return self.replace(password=password, password_file=None, password_env=None)

    @property
    def tls(self) -> bool:
        return bool(self.ca_cert or self.cert)

    def describe(self) -> str:
        """E.g. ``https://h:2379 as user job-a`` (never the password)."""
        scheme = "https" if self.tls else "http"
        who = f" as user {self.user!r}" if self.user else ""
        cert = " with a client certificate" if self.cert else ""
        eps = ",".join(f"{scheme}://{e.strip()}" for e in self.endpoints.split(",") if e.strip())
        return f"{eps}{who}{cert}"

    def connect(self, check_key: Optional[str] = None, *, check: bool = True, **overrides: Any) -> EtcdStore:
        """Open a client. With ``check``, fail at once (StoreError, one line) unless etcd answers
        and — when ``check_key`` is given — lets us read that key (a user limited to one prefix
        passes a key inside it). ``overrides``: ``timeout``/``retry_timeout``."""
        from elasticrun.store.client import connect  # the etcd library: imported when first needed

        s = self.resolved()
        return connect(
            s.endpoints,
            check=check,
            check_key=check_key,
            timeout=overrides.get("timeout", s.timeout),
            retry_timeout=overrides.get("retry_timeout", s.retry_timeout),
            user=s.user,
            password=s.password,
            ca_cert=s.ca_cert,
            cert_key=s.key,
            cert_cert=s.cert,
        )


def read_password_file(path: str) -> str:
    """The password in ``path`` (its first line); ConfigError (one line) when unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"cannot read the etcd password file {path!r}: {err.strerror}") from None
    lines = text.splitlines()
    password = lines[0] if lines else ""
    if not password:
        raise ConfigError(f"the etcd password file {path!r} is empty")
    return password


__all__ = ["EtcdSettings", "read_password_file"]
