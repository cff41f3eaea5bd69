"""The etcd connection flags shared by every command that talks to etcd (run, status)."""

from __future__ import annotations

import typer

PANEL = "etcd connection"

ETCD_USER = typer.Option(
    None, "--etcd-user", envvar="ELASTICRUN_ETCD_USER", help="etcd user (needs TLS).", rich_help_panel=PANEL
)
ETCD_PASSWORD = typer.Option(
    None, "--etcd-password", envvar="ELASTICRUN_ETCD_PASSWORD", help="etcd password.", rich_help_panel=PANEL
)
ETCD_CACERT = typer.Option(None, "--etcd-cacert", help="CA certificate for TLS.", rich_help_panel=PANEL)
ETCD_CERT = typer.Option(None, "--etcd-cert", help="Client certificate for TLS.", rich_help_panel=PANEL)
ETCD_KEY = typer.Option(None, "--etcd-key", help="Client key for TLS.", rich_help_panel=PANEL)
