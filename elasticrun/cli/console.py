"""Shared console helpers for the CLI: one rich console, one-line errors and notes, progress, JSON output.

Off a terminal (a pipe, a CI log, a file) the consoles never wrap or cut a line: every line
stays whole, whatever its length, so names and values can be copied and grepped. Long work
shows a rich progress bar on a terminal and, elsewhere, one progress line every few seconds.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NoReturn, Optional

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.text import Text

from elasticrun.sizes import format_size
from elasticrun.waiting import EVERY_S


class CliConsole(Console):
    """A rich console that soft-wraps (never wraps nor crops a line) when it does not write to a terminal."""

    _soft_wrap_set = False

    @property  # type: ignore[override]
    def soft_wrap(self) -> bool:
        return self._soft_wrap_set or not self.is_terminal

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:
        self._soft_wrap_set = bool(value)


console = CliConsole()
err_console = CliConsole(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``elasticrun: error: <message>`` on stderr and exit with ``code``; ``message`` is shown verbatim."""
    err_console.print(Text.assemble(("elasticrun: error:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    raise SystemExit(code)


def note(message: str) -> None:
    """Print ``elasticrun: <message>`` on stderr (what a command is doing or waiting for), verbatim."""
    err_console.print(Text.assemble(("elasticrun:", "dim"), " ", message), highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """Print ``elasticrun: warning: <message>`` on stderr, verbatim."""
    err_console.print(Text.assemble(("elasticrun: warning:", "bold yellow"), " ", message), highlight=False,
                      soft_wrap=True)


def print_json(data: Any) -> None:
    """Write ``data`` as JSON on stdout (for ``--json``), nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def local_time(t: Optional[float]) -> str:
    """A Unix time as ``2026-11-27 17:27:54`` in local time; ``-`` without one."""
    return "-" if not t else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


class ProgressLines:
    """Progress of long work where no bar can be drawn: ``<what>: 45% (1.2 GiB of 2.6 GiB)`` every few seconds."""

    def __init__(self, what: str, total: int, say: Callable[[str], None] = note, every: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.say, self.every, self.clock = what, total, say, every, clock
        self.done = 0
        self._next = clock() + every

    def advance(self, n: int) -> None:
        """``n`` more bytes are done; says the progress when a line is due."""
        self.done += n
        now = self.clock()
        if now >= self._next and self.done < self.total:
            self._next = now + self.every
            share = 100.0 * self.done / self.total if self.total else 100.0
            self.say(f"{self.what}: {share:.0f}% ({format_size(self.done)} of {format_size(self.total)})")


@contextmanager
def progress(total: int, what: str, every: float = EVERY_S) -> Iterator[Callable[[int], None]]:
    """Show the progress of work of ``total`` bytes; yields ``advance(n)``. A bar on a terminal (stderr),
    else a line every ``every`` seconds."""
    if not err_console.is_terminal:
        yield ProgressLines(what, total, every=every).advance
        return
    bar = Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=err_console, transient=True)
    task = bar.add_task(what, total=total)
    with bar:
        yield lambda n: bar.advance(task, n)
