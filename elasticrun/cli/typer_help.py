"""``--help`` of the typer commands (``etcd``, ``status``, ``ckpt ...``) in the layout of ``run --help``.

typer's own pages put options in boxes that cut long names at 80 columns (``--rdzv-endpoint,
--rdzv_endpo…``) and show ``<bool>`` after switches; these classes draw the same facts with
:mod:`elasticrun.cli.help_layout` instead: names whole, help wrapped at spaces, each default
and variable said once. A command opts in with ``cls=HelpCommand`` (a group: ``HelpGroup``).
"""

from __future__ import annotations

from typing import Any, Dict, List

import typer.core

from elasticrun.cli.console import console
from elasticrun.cli.help_layout import Entry, Section, render


def _unescape(text: str) -> str:
    return (text or "").replace("\\[", "[")


def _metavar(param: Any) -> str:
    return param.metavar or str(param.name).upper()


def _option_entry(param: Any) -> Entry:
    names = ", ".join(list(param.opts) + list(param.secondary_opts)) if param.secondary_opts else ", ".join(
        sorted(param.opts, key=lambda o: (o.startswith("--"), o)))
    if not param.is_flag:
        names += f" {_metavar(param)}"
    text = _unescape(param.help)
    default = param.default
    if param.required:
        text += " [required]"
    elif (param.show_default and not param.is_flag and default not in (None, "", [], ())
          and "[default" not in text and "(default" not in text):
        text += f" [default: {default}]"
    if param.envvar and "[env" not in text:
        envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
        text += f" [env: {', '.join(envvars)}]"
    return Entry(names, text.strip())


def _usage(command: Any, ctx: Any) -> str:
    parts = [f"Usage: {ctx.command_path} [OPTIONS]"]
    for param in command.params:
        if getattr(param, "param_type_name", "") != "argument" or getattr(param, "hidden", False):
            continue
        name = _metavar(param)
        name += "..." if param.nargs == -1 else ""
        parts.append(name if param.required else f"[{name}]")
    if isinstance(command, typer.core.TyperGroup):
        parts.append("COMMAND [ARGS]...")
    return " ".join(parts)


def _sections(command: Any, ctx: Any) -> List[Section]:
    arguments = Section("Arguments")
    panels: Dict[str, Section] = {"Options": Section("Options")}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if getattr(param, "param_type_name", "") == "argument":
            arguments.entries.append(Entry(_metavar(param), _unescape(getattr(param, "help", "") or "")))
            continue
        panel = getattr(param, "rich_help_panel", None) or "Options"
        panels.setdefault(panel, Section(panel)).entries.append(_option_entry(param))
    return [arguments, *panels.values()]


def _page(command: Any, ctx: Any, extra: List[Section]) -> str:
    with console.capture() as page:
        render(console, [_usage(command, ctx)], _unescape(command.help or ""), _sections(command, ctx) + extra)
    return page.get().rstrip("\n")


class HelpCommand(typer.core.TyperCommand):
    """A typer command whose ``--help`` uses elasticrun's help layout."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        formatter.write(_page(self, ctx, []))


class HelpGroup(typer.core.TyperGroup):
    """A typer group whose ``--help`` uses elasticrun's help layout (its commands listed last)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        commands = Section("Commands")
        for name in self.list_commands(ctx):
            sub = self.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                summary = _unescape(sub.help or "").strip().split("\n\n")[0]
                commands.entries.append(Entry(name, " ".join(summary.split())))
        formatter.write(_page(self, ctx, [commands]))


__all__ = ["HelpCommand", "HelpGroup"]
