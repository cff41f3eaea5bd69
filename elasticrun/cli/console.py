"""Shared console helpers for the CLI: one rich console, one-line errors, JSON output."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

from rich.console import Console
from rich.text import Text

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``elasticrun: error: <message>`` on stderr and exit with ``code``; ``message`` is shown verbatim."""
    err_console.print(Text.assemble(("elasticrun: error:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    raise SystemExit(code)


def print_json(data: Any) -> None:
    """Write ``data`` as JSON on stdout (for ``--json``), nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
