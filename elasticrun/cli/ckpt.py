"""``elasticrun ckpt``: manage sharded safetensors checkpoints (filled in by the checkpoint work)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Manage sharded safetensors checkpoints.", no_args_is_help=True)
