"""Tables of the CLI's read commands: a rich table on a terminal, plain aligned lines elsewhere.

Off a terminal (a pipe, a CI log) a :class:`DataTable` is a header line and one line per row,
columns separated by two spaces and never wrapped or cut: ``grep`` finds a row, ``awk`` a
column, and every name can be copied whole. On a terminal it is a rich table whose name
columns fold (every character kept) instead of ending in ``…``; a terminal too narrow for
the table gets the plain lines, folded at its width, rather than a squeezed table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Sequence, Union

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

Cell = Union[str, Text]
GAP = "  "


@dataclass(frozen=True)
class Column:
    """One column: its header, alignment, and what it holds (on a terminal: how it gives way when narrow)."""

    header: str
    justify: str = "left"  # "left" or "right"
    name: bool = False  # names or ids: folded over lines on a narrow terminal, never cut
    prose: bool = False  # free text: wrapped at spaces on a narrow terminal (other columns keep one line)


def _text(cell: Cell) -> Text:
    text = cell.copy() if isinstance(cell, Text) else Text(str(cell))
    if "\n" in text.plain:  # one row, one line
        text = Text(" ").join(text.split("\n", allow_blank=False))
    return text


class DataTable:
    """Rows of cells under ``columns``; a rich renderable (see the module docstring)."""

    def __init__(self, columns: Sequence[Column], title: str = "") -> None:
        self.columns = list(columns)
        self.title = title
        self.rows: List[List[Text]] = []

    def add_row(self, *cells: Cell) -> None:
        """Add one row (a cell per column; str is shown verbatim, never as markup)."""
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([_text(c) for c in cells])

    def plain_lines(self) -> Iterator[Text]:
        """The title, the header and one line per row, aligned, nothing cut."""
        if self.title:
            yield Text(self.title, style="bold")
        header = [Text(c.header, style="bold") for c in self.columns]
        widths = [max(len(t.plain) for t in col) for col in zip(header, *self.rows)]
        for cells in [header, *self.rows]:
            line = Text()
            for i, (cell, column, width) in enumerate(zip(cells, self.columns, widths)):
                pad = " " * (width - len(cell.plain))
                last = i == len(cells) - 1
                if column.justify == "right":
                    line.append(pad)
                    line.append_text(cell)
                else:
                    line.append_text(cell)
                    if not last:
                        line.append(pad)
                if not last:
                    line.append(GAP)
            line.rstrip()
            yield line

    def rich_table(self) -> Table:
        """The same rows as a rich table (for a terminal wide enough for it)."""
        table = Table(title=self.title or None, title_justify="left")
        for c in self.columns:
            table.add_column(c.header, justify=c.justify, overflow="fold", no_wrap=not (c.name or c.prose))  # type: ignore[arg-type]
        for row in self.rows:
            table.add_row(*row)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = list(self.plain_lines())
        if console.is_terminal:
            # A table with borders needs one column more per column, and 3 for its edges.
            if max(len(line.plain) for line in lines) + len(self.columns) + 3 <= options.max_width:
                yield self.rich_table()
                return
            for line in lines:  # too narrow for the table: the plain lines, folded by the terminal's width
                line.overflow = "fold"
                yield line
            return
        for line in lines:  # a pipe or a file: whole lines, never wrapped or cut
            line.no_wrap, line.overflow = True, "ignore"
            yield line
