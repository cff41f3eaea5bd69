"""The one layout of every ``--help`` page: usage, description, then sections of options, as argparse does.

An option's names start the line; its help follows in a column (on the next line when the names
are long), wrapped at spaces only, so that no flag or variable name is ever cut or broken, on a
terminal or in a pipe. Descriptions are reflowed to the width; lines indented by two spaces or
more (examples) are kept as written.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from typing import List, Sequence

from rich.console import Console
from rich.text import Text

NAMES_WIDTH = 28  # the help column starts after this (plus the indent and a gap)
INDENT = "  "
MAX_WIDTH = 100  # wider text is hard to read, even on a wide terminal
MIN_WIDTH = 60


@dataclass(frozen=True)
class Entry:
    """One option, argument or command: its names (as typed) and its help."""

    names: str
    help: str = ""


@dataclass
class Section:
    """A titled group of entries (``Options``, ``Rendezvous``, ``Commands``...)."""

    title: str
    entries: List[Entry] = field(default_factory=list)


def width_of(console: Console) -> int:
    """The width help is laid out for: the terminal's (80 in a pipe, or ``$COLUMNS``), within limits."""
    return max(MIN_WIDTH, min(MAX_WIDTH, console.width))


_KEEP = re.compile(r"\[(default|env):[^\]]*\]")  # kept on one line: "[default: 0.1]"
_NBSP = "\u00a0"  # textwrap breaks at ASCII whitespace only


def _wrap(text: str, width: int, indent: str = "") -> List[str]:
    text = _KEEP.sub(lambda m: m.group(0).replace(" ", _NBSP, -1 if len(m.group(0)) <= 30 else 1), text)
    lines = textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent,
                          break_long_words=False, break_on_hyphens=False)
    return [line.replace(_NBSP, " ") for line in lines] or [indent.rstrip()]


def reflow(text: str, width: int) -> List[str]:
    """``text`` as lines of at most ``width``: paragraphs joined and wrapped, indented lines kept."""
    lines: List[str] = []
    paragraph: List[str] = []

    def flush() -> None:
        if paragraph:
            lines.extend(_wrap(" ".join(paragraph), width))
            paragraph.clear()

    for raw in text.strip("\n").splitlines():
        line = raw.rstrip()
        if not line.strip():
            flush()
            lines.append("")
        elif line.startswith("  "):
            flush()
            lines.append(line)
        else:
            paragraph.append(line.strip())
    flush()
    return lines


def entry_lines(entry: Entry, width: int) -> List[Text]:
    """An entry as lines: names (styled), then its help in the column."""
    column = len(INDENT) + NAMES_WIDTH + 2
    names = Text(INDENT) + Text(entry.names, style="bold cyan")
    body = _wrap(entry.help, max(20, width - column)) if entry.help else []
    if not body:
        return [names]
    if len(INDENT) + len(entry.names) + 2 <= column:
        first = names + Text(" " * (column - len(INDENT) - len(entry.names)) + body[0])
        return [first] + [Text(" " * column + line) for line in body[1:]]
    return [names] + [Text(" " * column + line) for line in body]


def render(console: Console, usage: Sequence[str], description: str, sections: Sequence[Section]) -> None:
    """Print a help page: ``usage`` lines, the ``description``, then every non-empty section."""
    width = width_of(console)
    out: List[Text] = [Text(line) for line in usage]
    if description.strip():
        out.append(Text())
        out.extend(Text(line) for line in reflow(description, width))
    for section in sections:
        if not section.entries:
            continue
        out.append(Text())
        out.append(Text(f"{section.title}:", style="bold"))
        for entry in section.entries:
            out.extend(entry_lines(entry, width))
    for line in out:
        console.print(line, soft_wrap=True, highlight=False)


__all__ = ["Entry", "Section", "reflow", "render", "width_of"]
