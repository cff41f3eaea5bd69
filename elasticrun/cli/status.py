"""``elasticrun status``: the live view of a job (or the list of jobs) in etcd.

Data comes from :mod:`elasticrun.rendezvous.jobview`; this module only renders it
(rich tables, or one JSON document) and drives ``--watch`` from an etcd watch.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from elasticrun.cli.console import console, err_console, print_json
from elasticrun.cli.etcd_options import (
    ETCD_CACERT,
    ETCD_CERT,
    ETCD_KEY,
    ETCD_PASSWORD,
    ETCD_PASSWORD_FILE,
    ETCD_USER,
    settings_from_flags,
)
from elasticrun.cli.goodput_view import goodput_line, with_goodput
from elasticrun.errors import ElasticrunError
from elasticrun.job import env as job_env
from elasticrun.job.keys import ROOT, JobKeys
from elasticrun.rendezvous.jobview import (
    EVENTS_SHOWN,
    TERMINAL_PHASES,
    JobNotFoundError,
    build_job_status,
    job_phase,
    job_status,
    list_jobs,
)
from elasticrun.store.client import EtcdStore

HELP = """Show a job's round, members, ranks and recent rescale events (or list the jobs).

  elasticrun status --rdzv-endpoint etcd:2379 --rdzv-id job42            # one job
  elasticrun status --rdzv-endpoint etcd:2379 --rdzv-id job42 --watch    # live view until the job ends
  elasticrun status --rdzv-endpoint etcd:2379 --rdzv-id job42 --json     # one JSON document
  elasticrun status --rdzv-endpoint etcd:2379                            # every job in that etcd

With --watch --json, one JSON document per line is printed each time the job's keys change.
--watch of one job ends when the job ends; its exit code is then the job's outcome
(0 succeeded, 1 failed). Ctrl-C ends it earlier (exit 0).
"""

_MIN_REDRAW = 0.25  # seconds between redraws while watch events keep coming
_TICK = 1.0  # redraw of the rich view without events (ages, lease TTLs)

_STATUS_STYLE = {
    "Active": "green",
    "Joining": "cyan",
    "Rescaling": "yellow",
    "Leaving": "magenta",
    "Failed": "bold red",
    "Succeeded": "bold green",
    "Lost": "bold red",
    "Finished": "green",
}
_PHASE_STYLE = {"running": "green", "forming": "cyan", "rescaling": "yellow", "succeeded": "bold green",
                "failed": "bold red"}


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
    """The rich view of a status document (see :func:`elasticrun.rendezvous.jobview.build_job_status`)."""
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
        t = Table(title="members", title_justify="left", expand=False)
        for col in ("grank", "node", "host", "address", "status", "ranks", "accelerators", "heartbeat", "lease",
                    "progress"):
            t.add_column(col, overflow="fold")
        for m in doc["members"]:
            t.add_row(
                str(m["group_rank"]), escape(m["node_id"]), escape(str(m.get("host") or "-")),
                escape(str(m.get("addr") or "-")), _status(m["status"]), _ranks(m["ranks"]),
                _accelerators(m.get("accelerators") or []), _heartbeat(m, now), _lease(m),
                _progress(m.get("progress"), now),
            )
        lines.append(t)
    if doc.get("spares"):
        title = "waiting nodes (not in the round)" if doc.get("round") is not None else "registered nodes"
        t = Table(title=title, title_justify="left")
        for col in ("node", "host", "address", "status", "nproc", "waiting for", "registered", "lease"):
            t.add_column(col, overflow="fold")
        for s in doc["spares"]:
            wf = s.get("waiting_for")
            t.add_row(
                escape(s["node_id"]), escape(str(s.get("host") or "-")), escape(str(s.get("addr") or "-")),
                _status(s["status"]), str(s.get("nproc")), f"round {wf}" if wf is not None and wf >= 0 else "-",
                _ago(s.get("registered_at"), now), _lease(s),
            )
        lines.append(t)
    if doc.get("events"):
        t = Table(title="rescale events (newest first)", title_justify="left")
        for col in ("round", "type", "world", "added", "removed", "reason", "when"):
            t.add_column(col, overflow="fold")
        for e in doc["events"]:
            t.add_row(
                str(e["round"]), e["type"], f"{e['old_world_size']}→{e['new_world_size']}",
                escape(", ".join(e["added"]) or "-"), escape(", ".join(e["removed"]) or "-"),
                escape(e.get("reason") or ""), _ago(e.get("time"), now),
            )
        lines.append(t)
    return Group(*lines)


def render_jobs(rows: List[Dict[str, Any]], endpoint: str = "") -> RenderableType:
    """The table of jobs."""
    if not rows:
        return Text(f"no elasticrun jobs in etcd at {endpoint}")
    t = Table(title=f"jobs in etcd at {endpoint}", title_justify="left")
    for col in ("job", "state", "round", "world size", "nodes", "restarts", "nnodes"):
        t.add_column(col, overflow="fold")
    for r in rows:
        mr = r.get("max_restarts")
        t.add_row(
            escape(r["job"]), Text(r["phase"], style=_PHASE_STYLE.get(r["phase"], "")),
            "-" if r["round"] is None else str(r["round"]), str(r["world_size"]), str(r["nodes"]),
            f"{r['restart_count']}/{mr if mr is not None else '?'}", str(r.get("nnodes") or "-"),
        )
    return t


# -- watching ----------------------------------------------------------------------------------


def watch(
    store: EtcdStore,
    prefix: str,
    snapshot: Callable[[], Any],
    show: Callable[[Any, str], None],
    on_tick: bool,
    initial: Any = None,
    until: Optional[Callable[[Any], bool]] = None,
) -> Any:
    """Call ``show(snapshot(), error)`` now and after every batch of changes under ``prefix``.

    Driven by an etcd watch (bursts are coalesced to one redraw per ``_MIN_REDRAW`` s); with
    ``on_tick`` also once a second so ages and lease TTLs stay current. A dead watch (etcd
    restarted) is re-created; a failing read shows its error and is retried. Returns the last
    snapshot on Ctrl-C, or once ``until(snapshot)`` is true (after showing it).
    """
    changed = threading.Event()
    broken = threading.Event()
    cancel: Optional[Callable[[], None]] = None

    def on_error(_err: BaseException) -> None:
        broken.set()
        changed.set()

    last: Any = initial
    error = ""
    told = ""
    try:
        while True:
            if cancel is None or broken.is_set():
                if cancel is not None:
                    cancel()
                    cancel = None
                broken.clear()
                try:
                    cancel = store.watch_prefix(prefix, lambda _ev: changed.set(), on_error)
                except ElasticrunError as err:
                    error = str(err)
            fresh = False
            try:
                last, fresh = snapshot(), True
                if cancel is not None:
                    error = told = ""
            except ElasticrunError as err:
                error = str(err)
            if last is not None and (fresh or on_tick):
                show(last, error)
            if fresh and until is not None and until(last):
                return last
            elif error and error != told:
                err_console.print(Text(f"elasticrun: etcd: {error} (retrying)"), highlight=False, soft_wrap=True)
                told = error
            shown = time.monotonic()
            while True:
                fired = changed.wait(_TICK)
                if fired or on_tick or broken.is_set() or cancel is None:
                    break
            pause = _MIN_REDRAW - (time.monotonic() - shown)
            if pause > 0:
                time.sleep(pause)
            changed.clear()
    except KeyboardInterrupt:
        return last
    finally:
        if cancel is not None:
            cancel()


def _watch_rich(
    store: EtcdStore,
    prefix: str,
    snapshot: Callable[[], Any],
    render: Callable[[Any, str], RenderableType],
    initial: Any = None,
    until: Optional[Callable[[Any], bool]] = None,
) -> Any:
    """A rich.live view on a terminal; elsewhere (a pipe, a log file) the view is printed again
    on every change, separated by a rule, so the output stays readable."""
    if not console.is_terminal:

        def append(data: Any, error: str) -> None:
            console.rule(time.strftime("%H:%M:%S"))
            console.print(render(data, error))

        return watch(store, prefix, snapshot, append, on_tick=False, initial=initial, until=until)
    with Live(Text("reading etcd ..."), console=console, auto_refresh=False) as live:
        return watch(store, prefix, snapshot, lambda d, err: live.update(render(d, err), refresh=True), True,
                     initial, until)


def _json_line(data: Any, _error: str) -> None:
    sys.stdout.write(json.dumps(data, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


# -- the command -------------------------------------------------------------------------------


def status(
    rdzv_id: Optional[str] = typer.Option(
        None, "--rdzv-id", "--rdzv_id", "--run-id", help="Job to show \\[default: list every job]."
    ),
    rdzv_endpoint: str = typer.Option(
        "", "--rdzv-endpoint", "--rdzv_endpoint", envvar=job_env.RDZV_ENDPOINT,
        help="etcd endpoints host:port[,host:port...].",
    ),
    watch_: bool = typer.Option(False, "--watch", "-w", help="Live view, updated on every change (Ctrl-C to quit)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (with --watch: one per line)."),
    events: int = typer.Option(EVENTS_SHOWN, "--events", help="How many recent rescale events to show."),
    timeout: float = typer.Option(5.0, "--timeout", help="Seconds to keep trying an unreachable etcd."),
    etcd_user: Optional[str] = ETCD_USER,
    etcd_password: Optional[str] = ETCD_PASSWORD,
    etcd_password_file: Optional[str] = ETCD_PASSWORD_FILE,
    etcd_cacert: Optional[str] = ETCD_CACERT,
    etcd_cert: Optional[str] = ETCD_CERT,
    etcd_key: Optional[str] = ETCD_KEY,
) -> None:
    settings = settings_from_flags(
        rdzv_endpoint, user=etcd_user, password=etcd_password, password_file=etcd_password_file,
        cacert=etcd_cacert, cert=etcd_cert, key=etcd_key, retry_timeout=timeout,
    )
    # With a job: prove access inside its prefix (all a job's own etcd user may read).
    store = settings.connect(rdzv_id, timeout=min(timeout, 5.0))
    try:
        if rdzv_id is None:
            _show_jobs(store, watch_, as_json)
        else:
            _show_job(store, rdzv_id, watch_, as_json, events)
    finally:
        store.close()


def _show_jobs(store: EtcdStore, watch_: bool, as_json: bool) -> None:
    endpoint = store.endpoints
    if not watch_:
        rows = list_jobs(store)
        if as_json:
            print_json({"endpoint": endpoint, "jobs": rows})
        else:
            console.print(render_jobs(rows, endpoint))
        return
    snapshot = lambda: {"endpoint": endpoint, "jobs": list_jobs(store)}  # noqa: E731
    if as_json:
        watch(store, ROOT, snapshot, _json_line, on_tick=False)
        return
    _watch_rich(store, ROOT, snapshot, lambda d, err: Group(render_jobs(d["jobs"], endpoint), Text(err, style="red")))


def _show_job(store: EtcdStore, job: str, watch_: bool, as_json: bool, events: int) -> None:
    endpoint = store.endpoints
    doc = with_goodput(job_status(store, job, events=events))  # JobNotFoundError: one line, non-zero exit
    if not watch_ or ended(doc):
        if as_json:
            print_json(doc)
        else:
            console.print(render_job(doc, endpoint))
        if watch_:
            raise typer.Exit(outcome(doc))
        return

    def snapshot() -> Dict[str, Any]:
        try:
            return with_goodput(job_status(store, job, events=events))
        except JobNotFoundError:
            gone = build_job_status(job, [], 0, None, events)
            gone["phase"] = "gone"
            return gone

    if as_json:
        last = watch(store, JobKeys(job).prefix, snapshot, _json_line, on_tick=False, initial=doc, until=ended)
    else:
        last = _watch_rich(store, JobKeys(job).prefix, snapshot, lambda d, err: render_job(d, endpoint, err), doc,
                           until=ended)
    if last is not None and ended(last):
        raise typer.Exit(outcome(last))


def ended(doc: Dict[str, Any]) -> bool:
    """Has the job of status document ``doc`` ended (succeeded or failed)?"""
    return doc.get("phase") in TERMINAL_PHASES


def outcome(doc: Dict[str, Any]) -> int:
    """The exit code of ``status --watch`` for an ended job: 0 succeeded, 1 failed."""
    return 0 if doc.get("phase") == "succeeded" else 1


__all__ = ["HELP", "render_job", "render_jobs", "status", "watch"]
