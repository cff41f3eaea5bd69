"""The ``elasticrun run --help`` page, drawn from the option table (rich, grouped by panel)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from rich.console import Console
from rich.table import Table
from rich.text import Text

from elasticrun.cli.run_options import Kind, Opt, all_options

USAGE = "Usage: elasticrun [run] [OPTIONS] SCRIPT [SCRIPT ARGS]..."
COMMANDS_USAGE = "       elasticrun COMMAND [ARGS]...   (COMMAND --help for its own options)"


def _names(opt: Opt) -> str:
    names = ", ".join(opt.names + opt.negative)
    if opt.kind is Kind.VALUE:
        names += f" {opt.metavar or 'VALUE'}"
    return names


def _default(opt: Opt) -> str:
    if opt.kind is Kind.FLAG or opt.default in (None, ""):
        return ""
    return f" \\[default: {opt.default}]"


def _env(opt: Opt) -> str:
    names = ([opt.pet] if opt.pet else []) + list(opt.envvars)
    return f" \\[env: {', '.join(names)}]" if names else ""


def render(help_text: str, console: Console, commands: Sequence[Tuple[str, str]] = ()) -> None:
    """Print the usage line, ``help_text``, one table of options per panel, then ``commands`` (name, help)."""
    console.print(Text(USAGE))
    if commands:
        console.print(Text(COMMANDS_USAGE))
    console.print()
    console.print(Text(help_text.strip()))
    console.print()
    panels: Dict[str, List[Opt]] = {}
    for opt in all_options():
        panels.setdefault(opt.panel, []).append(opt)
    rows: List[Tuple[str, str]] = [("-h, --help", "Show this message and exit.")]
    table = Table(title="Options", title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(no_wrap=True, style="bold cyan")
    table.add_column()
    for name, text in rows:
        table.add_row(Text(name), Text(text))
    console.print(table)
    for panel, opts in panels.items():
        table = Table(title=panel, title_justify="left", show_header=False, box=None, pad_edge=False)
        table.add_column(no_wrap=True, style="bold cyan")
        table.add_column()
        for opt in opts:
            text = opt.help + _default(opt) + _env(opt)
            table.add_row(Text(_names(opt)), Text(text.replace("\\[", "[")))
        console.print()
        console.print(table)
    if commands:
        table = Table(title="Commands", title_justify="left", show_header=False, box=None, pad_edge=False)
        table.add_column(no_wrap=True, style="bold cyan")
        table.add_column()
        for name, text in commands:
            table.add_row(Text(name), Text(text))
        console.print()
        console.print(table)
