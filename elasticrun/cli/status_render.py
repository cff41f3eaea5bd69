"""How ``elasticrun status`` draws a job or the list of jobs (rich; no I/O).

What a job's view holds is decided by :mod:`elasticrun.cli.status_view` (pure); this module
turns it into rich text and tables. Worker, etcd and user text is shown verbatim
(``rich.text.Text``), never parsed as markup.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

from rich.console import Group, RenderableType
from rich.text import Text

from elasticrun.cli.goodput_view import goodput_line
from elasticrun.cli.status_view import PHASE_STYLE, Cell, Styled, TableView, job_view, restarts_cell
from elasticrun.cli.tables import Column, DataTable

MEMBER_COLUMNS = (Column("grank", "right"), Column("node", name=True), Column("host", name=True),
                  Column("address", name=True), Column("status"), Column("ranks"),
                  Column("accelerators", prose=True), Column("heartbeat"), Column("lease"),
                  Column("progress", prose=True))
SPARE_COLUMNS = (Column("node", name=True), Column("host", name=True), Column("address", name=True),
                 Column("status"), Column("nproc", "right"), Column("waiting for"), Column("registered"),
                 Column("lease"))
EVENT_COLUMNS = (Column("round", "right"), Column("type"), Column("world"), Column("added", name=True),
                 Column("removed", name=True), Column("kept in place", name=True), Column("reason", prose=True),
                 Column("when"))


def _text(line: Styled) -> Text:
    return Text(line.text, style=line.style)


def _cell(cell: Cell) -> Cell:
    return _text(cell) if isinstance(cell, Styled) else cell


def _table(view: Optional[TableView], columns: Sequence[Column]) -> List[DataTable]:
    if view is None:
        return []
    table = DataTable(columns, title=view.title)
    for row in view.rows:
        table.add_row(*(_cell(c) for c in row))
    return [table]


def render_job(doc: Dict[str, Any], endpoint: str = "", error: str = "") -> RenderableType:
    """The rich view of a status document (see :func:`elasticrun.rendezvous.jobstatus.build_job_status`)."""
    view = job_view(doc, doc.get("time") or time.time(), endpoint, error)
    head = Text.assemble(("job ", "bold"), (view.job, "bold"), "  ", (view.phase.text, view.phase.style),
                         (view.where, "dim"))
    goodput = goodput_line(view.goodput)
    lines: List[RenderableType] = [head, *map(_text, view.summary), *([goodput] if goodput is not None else []),
                                   *map(_text, view.ending)]
    return Group(*lines, *_table(view.members, MEMBER_COLUMNS), *_table(view.spares, SPARE_COLUMNS),
                 *_table(view.events, EVENT_COLUMNS))


def render_jobs(rows: List[Dict[str, Any]], endpoint: str = "") -> RenderableType:
    """The table of jobs."""
    if not rows:
        return Text(f"no elasticrun jobs in etcd at {endpoint}")
    t = DataTable([Column("job", name=True), Column("state"), Column("round", "right"),
                   Column("world size", "right"), Column("nodes", "right"), Column("restarts", "right"),
                   Column("nnodes")], title=f"jobs in etcd at {endpoint}")
    for r in rows:
        t.add_row(
            str(r["job"]), Text(r["phase"], style=PHASE_STYLE.get(r["phase"], "")),
            "-" if r["round"] is None else str(r["round"]), str(r["world_size"]), str(r["nodes"]),
            restarts_cell(r["restart_count"], r.get("max_restarts")), str(r.get("nnodes") or "-"),
        )
    return t


__all__ = ["render_job", "render_jobs"]
