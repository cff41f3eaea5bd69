"""The etcd connection flags shared by every command that talks to etcd (run, status, ckpt save).

They build one :class:`~elasticrun.job.settings.EtcdSettings` (:func:`settings_from_flags`).
The password comes from ``$ELASTICRUN_ETCD_PASSWORD`` or ``--etcd-password-file``;
``--etcd-password`` works but every user of the machine can read it in ``ps``.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from elasticrun.job import env as names
from elasticrun.job.settings import PASSWORD_IN_ARGV_WARNING, EtcdSettings, from_options, password_on_command_line

PANEL = "etcd connection"

ETCD_USER = typer.Option(
    None, "--etcd-user", envvar=names.ETCD_USER, help="etcd user (needs TLS: --etcd-cacert).", rich_help_panel=PANEL
)
ETCD_PASSWORD = typer.Option(
    None, "--etcd-password", envvar=names.ETCD_PASSWORD,
    help=f"etcd password. Prefer ${names.ETCD_PASSWORD} or --etcd-password-file: a flag shows in ps.",
    rich_help_panel=PANEL,
)
ETCD_PASSWORD_FILE = typer.Option(
    None, "--etcd-password-file", envvar=names.ETCD_PASSWORD_FILE,
    help="File holding the etcd password (first line; keep it mode 0600).", rich_help_panel=PANEL,
)
ETCD_CACERT = typer.Option(
    None, "--etcd-cacert", envvar=names.ETCD_CACERT, help="CA certificate for TLS.", rich_help_panel=PANEL
)
ETCD_CERT = typer.Option(
    None, "--etcd-cert", envvar=names.ETCD_CERT, help="Client certificate for TLS.", rich_help_panel=PANEL
)
ETCD_KEY = typer.Option(None, "--etcd-key", envvar=names.ETCD_KEY, help="Client key for TLS.", rich_help_panel=PANEL)


def settings_from_flags(
    endpoints: str,
    *,
    user: Optional[str] = None,
    password: Optional[str] = None,
    password_file: Optional[str] = None,
    cacert: Optional[str] = None,
    cert: Optional[str] = None,
    key: Optional[str] = None,
    retry_timeout: float = 10.0,
) -> EtcdSettings:
    """The connection settings of a command's etcd flags (ConfigError, one line, when unusable).
    Warns on stderr when the password was given on the command line."""
    if password_on_command_line(sys.argv):
        print(f"elasticrun: {PASSWORD_IN_ARGV_WARNING}", file=sys.stderr)
    return from_options(
        endpoints, user=user, password=password, password_file=password_file, ca_cert=cacert, cert=cert, key=key,
        retry_timeout=retry_timeout,
    )
