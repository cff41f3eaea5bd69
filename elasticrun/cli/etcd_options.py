"""The etcd connection flags shared by every command that talks to etcd (run, status, ckpt save).

Defined once, in :data:`FLAGS`. A typer command gets all six by taking one parameter
``etcd: EtcdFlags`` and the decorator :func:`with_etcd_flags`; ``elasticrun run`` (parsed
by hand, see :mod:`elasticrun.cli.run_options`) reads the same table. The values build one
:class:`~elasticrun.store.settings.EtcdSettings` (:meth:`EtcdFlags.settings`).
The password comes from ``$ELASTICRUN_ETCD_PASSWORD`` or ``--etcd-password-file``;
``--etcd-password`` works but every user of the machine can read it in ``ps``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar, get_type_hints

import typer

from elasticrun.job import env as names
from elasticrun.job.settings import PASSWORD_IN_ARGV_WARNING, from_options, password_on_command_line
from elasticrun.store.settings import EtcdSettings

PANEL = "etcd connection"


@dataclass(frozen=True)
class EtcdFlag:
    """One etcd connection flag: its :class:`EtcdFlags` field, spelling, variable and help."""

    field: str
    flag: str
    envvar: str
    help: str

    @property
    def dest(self) -> str:
        """The command parameter's name (``--etcd-user`` → ``etcd_user``)."""
        return self.flag[2:].replace("-", "_")

    def option(self) -> Any:
        """The ``typer.Option`` of this flag (default None)."""
        return typer.Option(None, self.flag, envvar=self.envvar, help=self.help, rich_help_panel=PANEL)


FLAGS = (
    EtcdFlag("user", "--etcd-user", names.ETCD_USER, "etcd user (needs TLS: --etcd-cacert)."),
    EtcdFlag("password", "--etcd-password", names.ETCD_PASSWORD,
             f"etcd password. Prefer ${names.ETCD_PASSWORD} or --etcd-password-file: a flag shows in ps."),
    EtcdFlag("password_file", "--etcd-password-file", names.ETCD_PASSWORD_FILE,
             "File holding the etcd password (first line; keep it mode 0600)."),
    EtcdFlag("cacert", "--etcd-cacert", names.ETCD_CACERT, "CA certificate for TLS."),
    EtcdFlag("cert", "--etcd-cert", names.ETCD_CERT, "Client certificate for TLS."),
    EtcdFlag("key", "--etcd-key", names.ETCD_KEY, "Client key for TLS."),
)


@dataclass(frozen=True)
class EtcdFlags:
    """The values of a command's etcd connection flags (None: not given)."""

    user: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)  # never shown
    password_file: Optional[str] = None
    cacert: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None

    def settings(self, endpoints: str, *, retry_timeout: float = 10.0) -> EtcdSettings:
        """The connection settings (ConfigError, one line, when unusable). Warns on stderr when
        the password was given on the command line."""
        if password_on_command_line(sys.argv):
            print(f"elasticrun: {PASSWORD_IN_ARGV_WARNING}", file=sys.stderr)
        return from_options(
            endpoints, user=self.user, password=self.password, password_file=self.password_file,
            ca_cert=self.cacert, cert=self.cert, key=self.key, retry_timeout=retry_timeout,
        )


assert [f.field for f in FLAGS] == [f.name for f in dataclasses.fields(EtcdFlags)]

F = TypeVar("F", bound=Callable[..., Any])


def with_etcd_flags(command: F) -> F:
    """Give a typer command the six etcd flags: its parameter ``etcd: EtcdFlags`` is replaced,
    for typer, by one option per :data:`FLAGS` entry (after the command's own), and the command
    is called with their values gathered in ``etcd``."""
    sig = inspect.signature(command)
    hints = get_type_hints(command)
    own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name != "etcd"]
    added = [inspect.Parameter(f.dest, inspect.Parameter.KEYWORD_ONLY, default=f.option(), annotation=Optional[str])
             for f in FLAGS]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["etcd"] = EtcdFlags(**{f.field: kwargs.pop(f.dest, None) for f in FLAGS})
        return command(*args, **kwargs)

    del wrapper.__wrapped__  # typer reads the signature below, not the command's
    wrapper.__signature__ = sig.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *added]}
    wrapper.__annotations__["return"] = hints.get("return")
    return wrapper  # type: ignore[return-value]


__all__ = ["FLAGS", "PANEL", "EtcdFlag", "EtcdFlags", "with_etcd_flags"]
