"""What ``elasticrun status`` shows of one job, as plain lines and table rows (pure; no rich, no clock).

:func:`job_view` turns a status document (:func:`elasticrun.rendezvous.jobstatus.build_job_status`)
and the time to show it at into a :class:`JobView`: the lines under the heading and the rows of
the members, waiting nodes and rescale events tables, each cell a string or a :class:`Styled`
one. :mod:`elasticrun.cli.status_render` draws it. Worker, etcd and user text stays verbatim.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from elasticrun.cli.console import local_time
from elasticrun.rendezvous.jobstatus import job_phase
from elasticrun.rendezvous.records import WorkerStatus
from elasticrun.rendezvous.states import JobPhase, MemberStatus

STATUS_STYLE = {  # keyed by value: a str enum hashes by its name
    WorkerStatus.ACTIVE.value: "green",
    WorkerStatus.JOINING.value: "cyan",
    WorkerStatus.RESCALING.value: "yellow",
    WorkerStatus.LEAVING.value: "magenta",
    WorkerStatus.FAILED.value: "bold red",
    WorkerStatus.SUCCEEDED.value: "bold green",
    MemberStatus.LOST.value: "bold red",
    MemberStatus.LEFT.value: "magenta",
    MemberStatus.FINISHED.value: "green",
}
PHASE_STYLE = {
    JobPhase.RUNNING.value: "green",
    JobPhase.FORMING.value: "cyan",
    JobPhase.RESCALING.value: "yellow",
    JobPhase.SUCCEEDED.value: "bold green",
    JobPhase.FAILED.value: "bold red",
    JobPhase.STOPPED.value: "magenta",
}


@dataclass(frozen=True)
class Styled:
    """Text with a rich style name ("" for none); the text is never read as markup."""

    text: str
    style: str = ""


Cell = Union[str, Styled]
Row = Tuple[Cell, ...]


@dataclass(frozen=True)
class TableView:
    """The rows of one table (its columns are the renderer's) under ``title``."""

    title: str
    rows: Tuple[Row, ...]


@dataclass(frozen=True)
class JobView:
    """One job as ``status`` shows it, top to bottom (a table is None when it would be empty)."""

    job: str
    phase: Styled
    where: str  # "   etcd <endpoint>, revision <n>", or "" without an endpoint
    summary: Tuple[Styled, ...]  # errors, a missing job, the round's line
    goodput: Optional[Dict[str, Any]]  # the job's aggregated goodput (drawn below the summary)
    ending: Tuple[Styled, ...]  # the job's end state, how the round ends, the nodes done
    members: Optional[TableView]
    spares: Optional[TableView]
    events: Optional[TableView]


# -- cells -------------------------------------------------------------------------------------


def ago(t: Optional[float], now: float) -> str:
    """``12.5s ago``, ``3m ago``, ``1.2h ago``; ``-`` without a time."""
    if not t:
        return "-"
    d = max(0.0, now - float(t))
    if d < 60:
        return f"{d:.1f}s ago"
    if d < 3600:
        return f"{d / 60:.0f}m ago"
    return f"{d / 3600:.1f}h ago"


def ranks_cell(ranks: List[int]) -> str:
    """A node's global ranks: ``3`` or ``4-7``."""
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def accelerators_cell(accs: List[Dict[str, Any]]) -> str:
    """``2x A100 (80 GiB), cpu x16``: identical GPUs counted."""
    if not accs:
        return "-"
    gpus = Counter(
        f"{a.get('name', 'gpu')} ({a.get('memory_gib', '?')} GiB)" for a in accs if a.get("type") == "gpu"
    )
    parts = [f"{n}x {name}" for name, n in gpus.items()]
    parts += [f"cpu x{a.get('count', '?')}" for a in accs if a.get("type") == "cpu"]
    return ", ".join(parts) or "-"


def heartbeat_cell(row: Dict[str, Any], now: float) -> str:
    """Last keep-alive (from the lease, 1 s resolution), else the node record's last update."""
    if row.get("lease_heartbeat_age") is not None:
        return f"~{row['lease_heartbeat_age']}s ago"
    return ago(row.get("heartbeat_at"), now)


def lease_cell(row: Dict[str, Any]) -> str:
    """``7/10s`` (seconds left of granted); ``-`` unknown; ``gone`` for a member without its record."""
    if row.get("lease_ttl") is None:
        return "-" if row.get("registered") else "gone"
    return f"{row['lease_ttl']}/{row.get('lease_granted_ttl') or '?'}s"


def progress_cell(p: Optional[Dict[str, Any]], now: float) -> str:
    """``step 120 · loss 0.5 · 33.0/s · 2.0s ago`` from a node's progress report."""
    if not p:
        return "-"
    parts = [f"step {p.get('step', '?')}"]
    if p.get("loss") is not None:
        parts.append(f"loss {float(p['loss']):.4g}")
    if p.get("samples_per_s") is not None:
        parts.append(f"{float(p['samples_per_s']):.1f}/s")
    parts.append(ago(p.get("time"), now))
    return " · ".join(parts)


def status_cell(s: str) -> Styled:
    return Styled(s, STATUS_STYLE.get(s, ""))


def member_status_cell(m: Dict[str, Any]) -> Styled:
    """A member's status, with ``straggler 2.1×`` when the leader scores it one."""
    if m.get("straggler"):
        ratio = m.get("straggler_ratio")
        return Styled(f"{m['status']} · straggler" + (f" {float(ratio):.2f}×" if ratio is not None else ""),
                      "bold yellow")
    return status_cell(m["status"])


def restarts_cell(count: Any, max_restarts: Any) -> str:
    """``1/3``: restarts used of the budget (``?`` when the job's config does not say)."""
    return f"{count}/{max_restarts if max_restarts is not None else '?'}"


# -- the view ----------------------------------------------------------------------------------


def _summary(doc: Dict[str, Any], now: float, error: str) -> Tuple[Styled, ...]:
    lines: List[Styled] = []
    if error:
        lines.append(Styled(f"etcd: {error} (retrying)", "bold red"))
    if not doc.get("exists", True):
        lines.append(Styled("the job has no keys in etcd (removed, or not started yet)", "yellow"))
    if doc.get("round") is None:
        lines.append(Styled("no round formed yet", "cyan"))
        return tuple(lines)
    lines.append(Styled(
        f"round {doc['round']} · world size {doc['world_size']} · {len(doc['members'])} node(s) · "
        f"restarts {restarts_cell(doc.get('restart_count', 0), doc.get('max_restarts'))} · "
        f"nnodes {doc.get('nnodes') or '?'} · master {doc.get('master_addr')}:{doc.get('master_port')} · "
        f"formed {ago(doc.get('round_created_at'), now)}"
    ))
    return tuple(lines)


def _ending(doc: Dict[str, Any], now: float) -> Tuple[Styled, ...]:
    lines: List[Styled] = []
    state = doc.get("state")
    if isinstance(state, dict):
        lines.append(Styled(f"state: {state.get('state')} — {state.get('reason', '')} (round {state.get('round')}, "
                            f"{ago(state.get('time'), now)})", PHASE_STYLE.get(str(state.get("state")), "")))
    expires = doc.get("expires_at")
    if isinstance(expires, (int, float)):
        lines.append(Styled(f"its keys leave etcd at {local_time(expires)} (--ended-job-ttl)", "dim"))
    end = doc.get("round_end") or {}
    if end.get("failed"):
        f = end["failed"]
        lines.append(Styled(f"round ending: worker failure on {f.get('node', '?')} (rank {f.get('rank')})", "red"))
    elif end.get("end"):
        lines.append(Styled(f"round ending: {end['end'].get('reason', '')}", "yellow"))
    if end.get("done"):
        lines.append(Styled(f"finished: {', '.join(end['done'])}", "green"))
    lines.extend(_health_lines(doc, now))
    return tuple(lines)


def _health_lines(doc: Dict[str, Any], now: float) -> List[Styled]:
    """Stragglers of this round and the nodes kept out of the job."""
    lines: List[Styled] = []
    scores = doc.get("stragglers") or {}
    for node, ratio in sorted((scores.get("nodes") or {}).items()):
        lines.append(Styled(f"straggler: {node}: compute {float(ratio):.2f}× the job's median per step "
                            f"(threshold {scores.get('threshold', '?')}×, window {scores.get('window_s', '?')} s)"
                            + (" — draining" if node in (scores.get("drain") or []) else ""), "bold yellow"))
    for ex in doc.get("excluded") or []:
        lines.append(Styled(f"excluded: {ex.get('node_id')} ({ex.get('why')}, {ago(ex.get('time'), now)}): "
                            f"{ex.get('reason', '')}", "red"))
    return lines


def _members(doc: Dict[str, Any], now: float) -> Optional[TableView]:
    rows = tuple(
        (str(m["group_rank"]), str(m["node_id"]), str(m.get("host") or "-"), str(m.get("addr") or "-"),
         member_status_cell(m), ranks_cell(m["ranks"]), accelerators_cell(m.get("accelerators") or []),
         heartbeat_cell(m, now), lease_cell(m), progress_cell(m.get("progress"), now))
        for m in doc.get("members") or []
    )
    return TableView("members", rows) if rows else None


def _waiting_for(wf: Any) -> str:
    return f"round {wf}" if wf is not None and wf >= 0 else "-"


def _spares(doc: Dict[str, Any], now: float) -> Optional[TableView]:
    rows = tuple(
        (str(s["node_id"]), str(s.get("host") or "-"), str(s.get("addr") or "-"), status_cell(s["status"]),
         str(s.get("nproc")), _waiting_for(s.get("waiting_for")), ago(s.get("registered_at"), now), lease_cell(s))
        for s in doc.get("spares") or []
    )
    if not rows:
        return None
    return TableView("waiting nodes (not in the round)" if doc.get("round") is not None else "registered nodes", rows)


def _events(doc: Dict[str, Any], now: float) -> Optional[TableView]:
    rows = tuple(
        (str(e["round"]), str(e["type"]), f"{e['old_world_size']}→{e['new_world_size']}",
         ", ".join(e["added"]) or "-", ", ".join(e["removed"]) or "-", ", ".join(e.get("kept") or []) or "-",
         str(e.get("reason") or ""),
         ago(e.get("time"), now))
        for e in doc.get("events") or []
    )
    return TableView("rescale events (newest first)", rows) if rows else None


def job_view(doc: Dict[str, Any], now: float, endpoint: str = "", error: str = "") -> JobView:
    """What ``status`` shows of the status document ``doc`` at time ``now`` (``error``: etcd's last
    error while watching; ``endpoint``: where the document was read, for the heading)."""
    phase = doc.get("phase") or job_phase(doc)
    return JobView(
        job=doc["job"],
        phase=Styled(phase, PHASE_STYLE.get(phase, "")),
        where=f"   etcd {endpoint}, revision {doc.get('revision', 0)}" if endpoint else "",
        summary=_summary(doc, now, error),
        goodput=doc.get("goodput"),
        ending=_ending(doc, now),
        members=_members(doc, now),
        spares=_spares(doc, now),
        events=_events(doc, now),
    )


__all__ = ["Cell", "JobView", "PHASE_STYLE", "Row", "STATUS_STYLE", "Styled", "TableView", "job_view"]
