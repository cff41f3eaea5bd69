"""The ``elasticrun run --help`` page, drawn from the option table (grouped by panel; layout: help_layout)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from rich.console import Console

from elasticrun.cli.help_layout import Entry, Section
from elasticrun.cli.help_layout import render as render_page
from elasticrun.cli.run_options import Kind, Opt, all_options

USAGE = "Usage: elasticrun [run] [OPTIONS] SCRIPT [SCRIPT ARGS]..."
COMMANDS_USAGE = "       elasticrun COMMAND [ARGS]...   (COMMAND --help for its own options)"


def _names(opt: Opt) -> str:
    names = ", ".join(opt.names + opt.negative)
    if opt.kind is Kind.VALUE:
        names += f" {opt.metavar or 'VALUE'}"
    return names


def _default(opt: Opt) -> str:
    """`` [default: X]`` unless the help says the default itself (or there is none to say)."""
    if opt.kind is Kind.FLAG or opt.default in (None, "") or "[default:" in opt.help:
        return ""
    return f" [default: {opt.default}]"


def _env(opt: Opt) -> str:
    names = ([opt.pet] if opt.pet else []) + list(opt.envvars)
    return f" [env: {', '.join(names)}]" if names else ""


def option_entry(opt: Opt) -> Entry:
    """The help entry of one option: names, help, default and variables (each said once)."""
    return Entry(_names(opt), opt.help.replace("\\[", "[") + _default(opt) + _env(opt))


def render(help_text: str, console: Console, commands: Sequence[Tuple[str, str]] = ()) -> None:
    """Print the usage line, ``help_text``, one section of options per panel, then ``commands`` (name, help)."""
    panels: Dict[str, List[Entry]] = {}
    for opt in all_options():
        panels.setdefault(opt.panel, []).append(option_entry(opt))
    sections = [Section("Options", [Entry("-h, --help", "Show this message and exit.")])]
    sections += [Section(panel, entries) for panel, entries in panels.items()]
    sections.append(Section("Commands", [Entry(name, text) for name, text in commands]))
    usage = [USAGE, COMMANDS_USAGE] if commands else [USAGE]
    render_page(console, usage, help_text, sections)
