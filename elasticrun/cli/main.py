"""The ``elasticrun`` command: ``elasticrun [run] script.py`` plus ``ckpt``, ``status``, ``etcd``.

``run`` is the default sub-command, so ``elasticrun --nproc-per-node 2 train.py`` works
exactly like ``torchrun``. Errors that are the user's to fix print one line, no traceback.
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Tuple

import typer

try:  # typer >= 0.22 carries its own copy of click
    from typer._click.exceptions import ClickException  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - older typer uses click itself
    from click.exceptions import ClickException  # type: ignore[import-not-found,no-redef]

from elasticrun import __version__
from elasticrun.cli.console import fail
from elasticrun.errors import ElasticrunError
from elasticrun.job.exitcodes import ExitCode, for_error

app = typer.Typer(
    name="elasticrun",
    help="Elastic distributed PyTorch launcher (torchrun-compatible) with an etcd v3 rendezvous.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_SUBCOMMANDS = {"run", "ckpt", "status", "etcd", "check"}


def _register() -> None:
    if app.registered_commands:
        return
    from elasticrun.cli import check, ckpt, etcd, run, status
    from elasticrun.cli.typer_help import HelpCommand

    # Listed for `elasticrun --help` only: `run` is parsed by elasticrun.cli.run (torchrun's grammar).
    app.command("run", help=run.HELP, add_help_option=False)(run.run)
    app.add_typer(ckpt.app, name="ckpt")
    app.command("status", help=status.HELP, cls=HelpCommand)(status.status)
    app.command("etcd", help=etcd.HELP, cls=HelpCommand)(etcd.etcd)
    app.command("check", help=check.HELP, cls=HelpCommand)(check.check)


def _commands() -> List[Tuple[str, str]]:
    """(name, first line of help) of every sub-command, for the top-level ``--help``."""
    _register()
    rows = []
    for info in app.registered_commands:
        rows.append((str(info.name), (info.help or "").strip().splitlines()[0]))
    for group in app.registered_groups:
        rows.append((str(group.name), (group.typer_instance.info.help or "").strip().splitlines()[0]))
    return rows


def _run_args(argv: List[str]) -> Optional[List[str]]:
    """The arguments of ``run`` when ``argv`` runs a script (``run`` is the default command), else None."""
    if not argv or argv[0] in ("--help", "-h", "--version"):
        return None
    if argv[0] == "run":
        return argv[1:]
    if argv[0] in _SUBCOMMANDS:
        return None
    return argv


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of the ``elasticrun`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--version":
        print(f"elasticrun {__version__}")
        return
    if not args or args[0] in ("-h", "--help"):
        # A torchrun user's first question: the launcher's flags, then the other sub-commands.
        from elasticrun.cli import run

        run.show_help(_commands())
        return
    try:
        run_args = _run_args(args)
        if run_args is not None:
            from elasticrun.cli import run

            raise SystemExit(run.main(run_args))
        _register()
        code = app(args=args, prog_name="elasticrun", standalone_mode=False)
        raise SystemExit(code if isinstance(code, int) else 0)
    except ClickException as err:  # a bad flag or argument of a typer command: one line, like ours
        if type(err).__name__ == "NoArgsIsHelpError" or not err.format_message().strip():
            _show_help(err)  # a group called without a command: its help, as for --help (exit 2)
            raise SystemExit(ExitCode.USAGE) from None
        fail(_usage_line(err), ExitCode.USAGE)
    except typer.Abort:  # a prompt answered with Ctrl-D or Ctrl-C
        fail("interrupted", ExitCode.INTERRUPTED)
    except ElasticrunError as err:
        fail(str(err), for_error(err))
    except KeyboardInterrupt:
        fail("interrupted", ExitCode.INTERRUPTED)


def _show_help(err: Any) -> None:
    ctx = getattr(err, "ctx", None)
    if ctx is not None:
        sys.stdout.write(ctx.get_help().rstrip("\n") + "\n")
        sys.stdout.flush()


def _usage_line(err: Any) -> str:
    """click's usage error as one line, with the command whose ``--help`` explains it."""
    ctx = getattr(err, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return f"{err.format_message().strip().rstrip('.')}{where}"
