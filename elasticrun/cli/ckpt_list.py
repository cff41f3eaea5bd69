"""What ``elasticrun ckpt list`` shows: the rows of both tiers and the notes (decided from what was
gathered, no I/O), and the table they are drawn as.

The command gathers the disk root's :class:`CheckpointInfo` entries and this machine's memory
snapshots (:mod:`elasticrun.cli.ckpt_memory`); :func:`plan_listing` decides what to say about
them, :func:`listing_table` draws the rows. Names and problems are shown verbatim, never as markup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from rich.text import Text

from elasticrun.checkpoint.validate import CheckpointInfo, CheckpointStatus
from elasticrun.cli.console import local_time
from elasticrun.cli.tables import Column, DataTable
from elasticrun.sizes import format_size

if TYPE_CHECKING:
    from elasticrun.cli.ckpt_memory import MemoryRow

_STATUS_STYLE = {CheckpointStatus.COMPLETE: "green", CheckpointStatus.INCOMPLETE: "yellow", CheckpointStatus.CORRUPT:
                 "bold red", CheckpointStatus.ALIAS: "cyan", CheckpointStatus.PARTIAL: "green"}
COLUMNS = (Column("name", name=True), Column("tier", prose=True), Column("step", "right"), Column("epoch", "right"),
           Column("world", "right"), Column("size", "right"), Column("created"), Column("status", prose=True))


@dataclass(frozen=True)
class ListRow:
    """One entry of either tier, with the cells ``list`` shows for it."""

    info: CheckpointInfo
    tier: str  # "disk", "memory" or "memory replica"
    owner: str  # a memory entry's "(job <id>, agent <pid>)"; "" on disk
    step: str
    epoch: str
    world: str
    size: str
    created: str


@dataclass(frozen=True)
class Listing:
    """What ``list`` prints: the notes (one line each), then, with rows, a table under ``title``."""

    notes: Tuple[str, ...]
    title: str
    rows: Tuple[ListRow, ...]


def shows_memory(root: Optional[str], memory: Optional[bool]) -> bool:
    """``--memory/--no-memory``, or by default: the memory tier without a ROOT, not with one."""
    return memory if memory is not None else root is None


def listing_json(root: Optional[str], infos: Sequence[CheckpointInfo], mem: Optional[Sequence[MemoryRow]]) -> List[
        Dict[str, Any]]:
    """The ``--json`` document: the disk entries, then the memory ones."""
    return [dict(i.to_json(), tier="disk", root=root) for i in infos] + [r.to_json() for r in mem or []]


def _row(info: CheckpointInfo, tier: str, owner: str = "") -> ListRow:
    m = info.meta
    return ListRow(
        info, tier, owner,
        step="-" if m is None or m.step is None else str(m.step),
        epoch="-" if m is None or m.epoch is None else str(m.epoch),
        world="-" if m is None else str(m.world_size),
        size=format_size(info.size),
        created=local_time(info.created),
    )


def _memory_row(r: MemoryRow) -> ListRow:
    tier = "memory replica" if r.kind == "replica" else "memory"
    return _row(r.info, tier, f"(job {r.where.job}, agent {r.where.agent_pid})")


def plan_listing(root: Optional[str], infos: Sequence[CheckpointInfo], mem: Optional[Sequence[MemoryRow]],
                 job: Optional[str] = None) -> Listing:
    """What to say about the disk root's entries (``root`` None: none asked for) and the memory
    snapshots (``mem`` None: not asked for; ``job``: the job they were filtered by)."""
    notes: List[str] = []
    if not infos and root is not None:
        notes.append(f"no checkpoints in {root}")
    if mem is not None and not mem:
        notes.append("no memory snapshots on this machine" + (f" for job {job}" if job else "") +
                     " (no running elasticrun agent of yours keeps any in /dev/shm)")
    where = " and ".join(([root] if root is not None else []) + (["this machine's memory"] if mem else []))
    rows = tuple(_row(i, "disk") for i in infos) + tuple(_memory_row(r) for r in mem or [])
    return Listing(tuple(notes), f"checkpoints in {where}", rows)


def name_cell(i: CheckpointInfo) -> Text:
    """The name (verbatim), with the marks ``list`` adds: latest, temporary, alias target."""
    name = Text(i.name)
    if i.latest:
        name.append(" ← latest", style="bold cyan")
    if i.temporary:
        name.append(" (tmp)", style="dim")
    if i.alias_of is not None:
        name.append(f" → {i.alias_of} (alias)", style="dim")
    return name


def status_cell(i: CheckpointInfo) -> Text:
    """The status, and for a damaged entry what is wrong (verbatim, whole)."""
    status = Text(str(i.status), style=_STATUS_STYLE.get(i.status, ""))
    if i.problem and i.status != CheckpointStatus.COMPLETE:
        status.append(f" ({i.problem})", style="dim")
    return status


def _tier_cell(row: ListRow) -> Text:
    if not row.owner:
        return Text(row.tier)
    return Text.assemble(f"{row.tier} ", (row.owner, "dim"))


def listing_table(listing: Listing) -> DataTable:
    """The rows of ``listing`` as the table ``list`` prints."""
    table = DataTable(COLUMNS, title=listing.title)
    for r in listing.rows:
        table.add_row(name_cell(r.info), _tier_cell(r), r.step, r.epoch, r.world, r.size, r.created,
                      status_cell(r.info))
    return table


__all__ = ["ListRow", "Listing", "listing_json", "listing_table", "name_cell", "plan_listing", "shows_memory",
           "status_cell"]
