"""How ``elasticrun status`` draws a status document or the list of jobs (rich; no I/O).

The documents come from :mod:`elasticrun.rendezvous.jobstatus`; worker, etcd and user text in
them is shown verbatim (``rich.text.Text`` or escaped), never parsed as markup.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Dict, List, Optional

from rich.console import Group, RenderableType
from rich.text import Text

from elasticrun.cli.goodput_view import goodput_line
from elasticrun.cli.tables import Column, DataTable
from elasticrun.rendezvous.jobstatus import job_phase
from elasticrun.rendezvous.records import WorkerStatus
from elasticrun.rendezvous.states import JobPhase, MemberStatus

_STATUS_STYLE = {  # keyed by value: a str enum hashes by its name
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
_PHASE_STYLE = {
    JobPhase.RUNNING.value: "green",
    JobPhase.FORMING.value: "cyan",
    JobPhase.RESCALING.value: "yellow",
    JobPhase.SUCCEEDED.value: "bold green",
    JobPhase.FAILED.value: "bold red",
    JobPhase.STOPPED.value: "magenta",
}


# -- formatting helpers ----------------------------------------------------------------------


def _ago(t: Optional[float], now: float) -> str:
    if not t:
        return "-"
    d = max(0.0, now - float(t))
    if d < 60:
        return f"{d:.1f}s ago"
    if d < 3600:
        return f"{d / 60:.0f}m ago"
    return f"{d / 3600:.1f}h ago"


def _ranks(ranks: List[int]) -> str:
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _accelerators(accs: List[Dict[str, Any]]) -> str:
    if not accs:
        return "-"
    gpus = Counter(
        f"{a.get('name', 'gpu')} ({a.get('memory_gib', '?')} GiB)" for a in accs if a.get("type") == "gpu"
    )
    parts = [f"{n}x {name}" for name, n in gpus.items()]
    parts += [f"cpu x{a.get('count', '?')}" for a in accs if a.get("type") == "cpu"]
    return ", ".join(parts) or "-"


def _heartbeat(row: Dict[str, Any], now: float) -> str:
    """Last keep-alive (from the lease, 1 s resolution), else the node record's last update."""
    if row.get("lease_heartbeat_age") is not None:
        return f"~{row['lease_heartbeat_age']}s ago"
    return _ago(row.get("heartbeat_at"), now)


def _lease(row: Dict[str, Any]) -> str:
    if row.get("lease_ttl") is None:
        return "-" if row.get("registered") else "gone"
    return f"{row['lease_ttl']}/{row.get('lease_granted_ttl') or '?'}s"


def _progress(p: Optional[Dict[str, Any]], now: float) -> str:
    if not p:
        return "-"
    parts = [f"step {p.get('step', '?')}"]
    if p.get("loss") is not None:
        parts.append(f"loss {float(p['loss']):.4g}")
    if p.get("samples_per_s") is not None:
        parts.append(f"{float(p['samples_per_s']):.1f}/s")
    parts.append(_ago(p.get("time"), now))
    return " · ".join(parts)


def _status(s: str) -> Text:
    return Text(s, style=_STATUS_STYLE.get(s, ""))


# -- rendering ---------------------------------------------------------------------------------


def render_job(doc: Dict[str, Any], endpoint: str = "", error: str = "") -> RenderableType:
    """The rich view of a status document (see :func:`elasticrun.rendezvous.jobstatus.build_job_status`)."""
    now = doc.get("time") or time.time()
    phase = doc.get("phase") or job_phase(doc)
    head = Text.assemble(
        ("job ", "bold"), (doc["job"], "bold"), "  ", (phase, _PHASE_STYLE.get(phase, "")),
        (f"   etcd {endpoint}, revision {doc.get('revision', 0)}" if endpoint else "", "dim"),
    )
    lines: List[RenderableType] = [head]
    if error:
        lines.append(Text(f"etcd: {error} (retrying)", style="bold red"))
    if not doc.get("exists", True):
        lines.append(Text("the job has no keys in etcd (removed, or not started yet)", style="yellow"))
    max_r = doc.get("max_restarts")
    restarts = f"{doc.get('restart_count', 0)}/{max_r if max_r is not None else '?'}"
    if doc.get("round") is None:
        lines.append(Text("no round formed yet", style="cyan"))
    else:
        master = f"{doc.get('master_addr')}:{doc.get('master_port')}"
        lines.append(Text(
            f"round {doc['round']} · world size {doc['world_size']} · {len(doc['members'])} node(s) · "
            f"restarts {restarts} · nnodes {doc.get('nnodes') or '?'} · master {master} · "
            f"formed {_ago(doc.get('round_created_at'), now)}"
        ))
    goodput = goodput_line(doc.get("goodput"))
    if goodput is not None:
        lines.append(goodput)
    state = doc.get("state")
    if isinstance(state, dict):
        lines.append(Text(f"state: {state.get('state')} — {state.get('reason', '')} (round {state.get('round')}, "
                          f"{_ago(state.get('time'), now)})", style=_PHASE_STYLE.get(str(state.get('state')), "")))
    end = doc.get("round_end") or {}
    if end.get("failed"):
        f = end["failed"]
        lines.append(Text(f"round ending: worker failure on {f.get('node', '?')} (rank {f.get('rank')})",
                          style="red"))
    elif end.get("end"):
        lines.append(Text(f"round ending: {end['end'].get('reason', '')}", style="yellow"))
    if end.get("done"):
        lines.append(Text(f"finished: {', '.join(end['done'])}", style="green"))

    if doc.get("members"):
        t = DataTable([Column("grank", "right"), Column("node", name=True), Column("host", name=True),
                       Column("address", name=True), Column("status"), Column("ranks"),
                       Column("accelerators", prose=True), Column("heartbeat"), Column("lease"),
                       Column("progress", prose=True)], title="members")
        for m in doc["members"]:
            t.add_row(
                str(m["group_rank"]), str(m["node_id"]), str(m.get("host") or "-"), str(m.get("addr") or "-"),
                _status(m["status"]), _ranks(m["ranks"]), _accelerators(m.get("accelerators") or []),
                _heartbeat(m, now), _lease(m), _progress(m.get("progress"), now),
            )
        lines.append(t)
    if doc.get("spares"):
        title = "waiting nodes (not in the round)" if doc.get("round") is not None else "registered nodes"
        t = DataTable([Column("node", name=True), Column("host", name=True), Column("address", name=True),
                       Column("status"), Column("nproc", "right"), Column("waiting for"), Column("registered"),
                       Column("lease")], title=title)
        for s in doc["spares"]:
            wf = s.get("waiting_for")
            t.add_row(
                str(s["node_id"]), str(s.get("host") or "-"), str(s.get("addr") or "-"), _status(s["status"]),
                str(s.get("nproc")), f"round {wf}" if wf is not None and wf >= 0 else "-",
                _ago(s.get("registered_at"), now), _lease(s),
            )
        lines.append(t)
    if doc.get("events"):
        t = DataTable([Column("round", "right"), Column("type"), Column("world"), Column("added", name=True),
                       Column("removed", name=True), Column("reason", prose=True), Column("when")],
                      title="rescale events (newest first)")
        for e in doc["events"]:
            t.add_row(
                str(e["round"]), str(e["type"]), f"{e['old_world_size']}→{e['new_world_size']}",
                ", ".join(e["added"]) or "-", ", ".join(e["removed"]) or "-", str(e.get("reason") or ""),
                _ago(e.get("time"), now),
            )
        lines.append(t)
    return Group(*lines)


def render_jobs(rows: List[Dict[str, Any]], endpoint: str = "") -> RenderableType:
    """The table of jobs."""
    if not rows:
        return Text(f"no elasticrun jobs in etcd at {endpoint}")
    t = DataTable([Column("job", name=True), Column("state"), Column("round", "right"),
                   Column("world size", "right"), Column("nodes", "right"), Column("restarts", "right"),
                   Column("nnodes")], title=f"jobs in etcd at {endpoint}")
    for r in rows:
        mr = r.get("max_restarts")
        t.add_row(
            str(r["job"]), Text(r["phase"], style=_PHASE_STYLE.get(r["phase"], "")),
            "-" if r["round"] is None else str(r["round"]), str(r["world_size"]), str(r["nodes"]),
            f"{r['restart_count']}/{mr if mr is not None else '?'}", str(r.get("nnodes") or "-"),
        )
    return t


__all__ = ["render_job", "render_jobs"]
