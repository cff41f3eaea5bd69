"""``elasticrun status``: the live view of a job (or the list of jobs) in etcd.

Data comes from :mod:`elasticrun.rendezvous.jobstatus`, drawn by :mod:`elasticrun.cli.status_render`
(or printed as one JSON document); this module is the command and drives ``--watch`` from an etcd watch.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from elasticrun.cli import values
from elasticrun.cli.console import console, err_console, print_json
from elasticrun.cli.etcd_options import EtcdFlags, with_etcd_flags
from elasticrun.cli.goodput_view import with_goodput
from elasticrun.cli.status_render import render_job, render_jobs
from elasticrun.errors import ElasticrunError
from elasticrun.job import env as job_env
from elasticrun.job.keys import ROOT, JobKeys
from elasticrun.rendezvous.jobstatus import (
    EVENTS_SHOWN,
    JobNotFoundError,
    build_job_status,
    job_status,
    list_jobs,
)
from elasticrun.rendezvous.states import TERMINAL_PHASES, JobPhase
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


@with_etcd_flags
def status(
    rdzv_id: Optional[str] = typer.Option(
        None, "--rdzv-id", "--rdzv_id", "--run-id", help="Job to show \\[default: list every job]."
    ),
    rdzv_endpoint: str = typer.Option(
        "", "--rdzv-endpoint", "--rdzv_endpoint", envvar=job_env.RDZV_ENDPOINT, callback=values.endpoints,
        help="etcd endpoints host:port[,host:port...].",
    ),
    watch_: bool = typer.Option(False, "--watch", "-w", help="Live view, updated on every change (Ctrl-C to quit)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (with --watch: one per line)."),
    events: int = typer.Option(EVENTS_SHOWN, "--events", min=0, help="How many recent rescale events to show."),
    timeout: float = typer.Option(5.0, "--timeout", callback=values.seconds(),
                                  help="Seconds to keep trying an unreachable etcd."),
    etcd: EtcdFlags = EtcdFlags(),
) -> None:
    settings = etcd.settings(rdzv_endpoint, retry_timeout=timeout)
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
            gone["phase"] = JobPhase.GONE.value
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
    return 0 if doc.get("phase") == JobPhase.SUCCEEDED else 1


__all__ = ["HELP", "status", "watch"]
