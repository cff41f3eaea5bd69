"""How to reach the job's etcd: one value from the flags to the agent, the workers and the CLI.

:class:`EtcdSettings` holds the endpoints, the TLS files, the user and where the password
comes from (an environment variable or a file; ``--etcd-password`` works but shows in
``ps``). The agent resolves the password once and hands the settings to its workers in a
0600 JSON file named by ``ELASTICRUN_ETCD_SETTINGS_FILE``; the password itself is never
put in a worker's environment or command line. Every connection — agent, workers (commit
fence, progress reports, checkpoint requests), ``status``, ``ckpt save`` — is opened with
:meth:`EtcdSettings.connect`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

from elasticrun.errors import ConfigError
from elasticrun.job import env as names
from elasticrun.job.keys import JobKeys

if TYPE_CHECKING:
    from elasticrun.store.client import EtcdStore

_FILE_FIELDS = ("endpoints", "ca_cert", "cert", "key", "user", "password", "timeout", "retry_timeout")


@dataclass(frozen=True)
class EtcdSettings:
    """Connection settings for one etcd cluster (the password never shows in ``repr``).

    Exactly one password source is used: ``password`` (already resolved), else the file
    ``password_file``, else the environment variable ``password_env``.
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

    # -- building ---------------------------------------------------------------------

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
            raise ConfigError(
                f"etcd user {self.user!r} has no password: set {names.ETCD_PASSWORD} or pass "
                "--etcd-password-file FILE"
            )
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

    # -- the file the agent hands to its workers ---------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        s = self.resolved()
        d = {k: getattr(s, k) for k in _FILE_FIELDS}
        for k in ("ca_cert", "cert", "key"):
            if d[k]:
                d[k] = os.path.abspath(d[k])
        return d

    def write(self, path: str) -> str:
        """Write the resolved settings to ``path`` (mode 0600, atomically); returns ``path``."""
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".etcd-settings-", dir=directory)  # mkstemp: mode 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    @classmethod
    def read(cls, path: str) -> EtcdSettings:
        """Settings from a file written by :meth:`write` (ConfigError, one line, if unusable)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            return cls(**{k: data.get(k) for k in _FILE_FIELDS if data.get(k) is not None})
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(
                f"cannot read the etcd settings file {path!r} ({names.ETCD_SETTINGS_FILE}): {err}"
            ) from None

    @classmethod
    def from_env(
        cls, env: Optional[Mapping[str, str]] = None, endpoints: Optional[str] = None
    ) -> Optional[EtcdSettings]:
        """A worker's settings: the agent's settings file, else the bare endpoint (None: no etcd).

        ``endpoints`` (when given) overrides the endpoints of either.
        """
        env = os.environ if env is None else env
        path = env.get(names.ETCD_SETTINGS_FILE, "").strip()
        if path:
            settings = cls.read(path)
            return settings.replace(endpoints=endpoints) if endpoints else settings
        endpoints = endpoints or env.get(names.RDZV_ENDPOINT, "").strip()
        return cls(endpoints=endpoints) if endpoints else None

    # -- connecting ------------------------------------------------------------------------

    def connect(self, job_id: Optional[str] = None, *, check: bool = True, **overrides: Any) -> EtcdStore:
        """Open a client. With ``check``, fail at once (StoreError, one line) unless etcd answers
        and — when ``job_id`` is given — lets us read inside that job's prefix (the only place a
        job's user may read). ``overrides``: ``timeout``/``retry_timeout``."""
        from elasticrun.store.client import connect

        s = self.resolved()
        return connect(
            s.endpoints,
            check=check,
            check_key=JobKeys(job_id).ping if job_id else None,
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


def from_options(
    endpoints: str,
    *,
    user: Optional[str] = None,
    password: Optional[str] = None,
    password_file: Optional[str] = None,
    ca_cert: Optional[str] = None,
    cert: Optional[str] = None,
    key: Optional[str] = None,
    timeout: float = 5.0,
    retry_timeout: float = 10.0,
) -> EtcdSettings:
    """Settings from the CLI's etcd flags (:mod:`elasticrun.cli.etcd_options`), resolved."""
    if password is not None and password_file:
        raise ConfigError("give the etcd password once: --etcd-password-file or $" + names.ETCD_PASSWORD + ", not both")
    return EtcdSettings(
        endpoints=endpoints,
        ca_cert=ca_cert or None,
        cert=cert or None,
        key=key or None,
        user=user or None,
        password=password,
        password_file=password_file or None,
        timeout=timeout,
        retry_timeout=retry_timeout,
    ).resolved()


def from_config(cfg: Any) -> EtcdSettings:
    """The settings of a :class:`~elasticrun.launch.config.LaunchConfig` (its ``etcd_*`` fields), resolved."""
    return from_options(
        cfg.rdzv_endpoint,
        user=getattr(cfg, "etcd_user", None),
        password=getattr(cfg, "etcd_password", None),
        password_file=getattr(cfg, "etcd_password_file", None),
        ca_cert=getattr(cfg, "etcd_cacert", None),
        cert=getattr(cfg, "etcd_cert", None),
        key=getattr(cfg, "etcd_key", None),
        timeout=5.0,
        retry_timeout=float(getattr(cfg, "etcd_timeout", 10.0)),
    )


def password_on_command_line(argv: Sequence[str]) -> bool:
    """True when ``argv`` carries ``--etcd-password`` (visible to every user in ``ps``)."""
    return any(a == "--etcd-password" or a.startswith("--etcd-password=") for a in argv)


def drop_secrets_from_environment(cfg: Any, say: Any = None) -> EtcdSettings:
    """Agent start: resolve the etcd settings of ``cfg`` (fails at once on a bad password source),
    then remove :data:`~elasticrun.job.env.SECRET_NAMES` from ``os.environ`` so that no child
    (workers, standby interpreters, a hosted etcd) inherits them. ``say`` gets the ``ps`` warning."""
    settings = from_config(cfg)
    if say is not None and password_on_command_line(sys.argv):
        say(PASSWORD_IN_ARGV_WARNING)
    for name in names.SECRET_NAMES:
        os.environ.pop(name, None)
    return settings


PASSWORD_IN_ARGV_WARNING = (
    "warning: --etcd-password is visible to every user of this machine (ps, /proc); set "
    f"{names.ETCD_PASSWORD} or use --etcd-password-file instead"
)


__all__ = [
    "EtcdSettings", "PASSWORD_IN_ARGV_WARNING", "drop_secrets_from_environment", "from_config", "from_options",
    "password_on_command_line", "read_password_file",
]
