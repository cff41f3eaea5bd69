"""How the etcd settings travel: from the flags to the agent, the workers and the CLI.

The connection settings themselves are :class:`~elasticrun.store.settings.EtcdSettings` (a plain
value of the etcd boundary). This module is the contract around them: the password comes from
``ELASTICRUN_ETCD_PASSWORD`` or a file (``--etcd-password`` works but shows in ``ps``); the agent
resolves it once and hands the settings to its workers in a 0600 JSON file named by
``ELASTICRUN_ETCD_SETTINGS_FILE`` (:func:`to_file`, :func:`from_env`); the password itself is never
put in a worker's environment or command line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from elasticrun.errors import ConfigError
from elasticrun.job import env as names
from elasticrun.store.settings import EtcdSettings

_FILE_FIELDS = ("endpoints", "ca_cert", "cert", "key", "user", "password", "timeout", "retry_timeout")


def to_dict(settings: EtcdSettings) -> Dict[str, Any]:
    """The settings file's content: ``settings`` resolved, TLS file paths made absolute."""
    s = settings.resolved()
    d = {k: getattr(s, k) for k in _FILE_FIELDS}
    for k in ("ca_cert", "cert", "key"):
        if d[k]:
            d[k] = os.path.abspath(d[k])
    return d


def to_file(settings: EtcdSettings, path: str) -> str:
    """Write the resolved ``settings`` to ``path`` (mode 0600, atomically); returns ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".etcd-settings-", dir=directory)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(to_dict(settings), f)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def from_file(path: str) -> EtcdSettings:
    """Settings from a file written by :func:`to_file` (ConfigError, one line, if unusable)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return EtcdSettings(**{k: data.get(k) for k in _FILE_FIELDS if data.get(k) is not None})
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(
            f"cannot read the etcd settings file {path!r} ({names.ETCD_SETTINGS_FILE}): {err}"
        ) from None


def from_env(env: Optional[Mapping[str, str]] = None, endpoints: Optional[str] = None) -> Optional[EtcdSettings]:
    """A worker's settings: the agent's settings file, else the bare endpoint (None: no etcd).

    ``endpoints`` (when given) overrides the endpoints of either.
    """
    env = os.environ if env is None else env
    path = env.get(names.ETCD_SETTINGS_FILE, "").strip()
    if path:
        settings = from_file(path)
        return settings.replace(endpoints=endpoints) if endpoints else settings
    endpoints = endpoints or env.get(names.RDZV_ENDPOINT, "").strip()
    return EtcdSettings(endpoints=endpoints) if endpoints else None


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
        password_env=names.ETCD_PASSWORD,
        timeout=timeout,
        retry_timeout=retry_timeout,
    ).resolved()


def password_on_command_line(argv: Sequence[str]) -> bool:
    """True when ``argv`` carries ``--etcd-password`` (visible to every user in ``ps``)."""
    return any(a == "--etcd-password" or a.startswith("--etcd-password=") for a in argv)


def drop_secrets_from_environment(say: Optional[Callable[[str], None]] = None) -> None:
    """Agent start, once its etcd settings are resolved (a bad password source has failed by then):
    remove :data:`~elasticrun.job.env.SECRET_NAMES` from ``os.environ`` so that no child (workers,
    standby interpreters, a hosted etcd) inherits them. ``say`` gets the ``ps`` warning."""
    if say is not None and password_on_command_line(sys.argv):
        say(PASSWORD_IN_ARGV_WARNING)
    for name in names.SECRET_NAMES:
        os.environ.pop(name, None)


PASSWORD_IN_ARGV_WARNING = (
    "warning: --etcd-password is visible to every user of this machine (ps, /proc); set "
    f"{names.ETCD_PASSWORD} or use --etcd-password-file instead"
)


__all__ = [
    "PASSWORD_IN_ARGV_WARNING", "drop_secrets_from_environment", "from_env", "from_file",
    "from_options", "password_on_command_line", "to_dict", "to_file",
]
