"""``elasticrun status``: the live view of a job (or the list of jobs) in etcd.

Data comes from :mod:`elasticrun.rendezvous.jobstatus`, drawn by :mod:`elasticrun.cli.status_render`
(or printed as one JSON document); this module is the command and drives ``--watch`` from an etcd watch.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from elasticrun.cli import values
from elasticrun.cli.console import console, err_console, print_json
from elasticrun.cli.etcd_options import EtcdFlags, with_etcd_flags
from elasticrun.cli.goodput_view import with_goodput
from elasticrun.cli.status_render import render_job, render_jobs
from elasticrun.errors import ElasticrunError, StoreError
from elasticrun.job import env as job_env
from elasticrun.job import records
from elasticrun.job.keys import ROOT, JobKeys
from elasticrun.rendezvous.jobstatus import (
    EVENTS_SHOWN,
    JobNotFoundError,
    build_job_status,
    job_phase,
    job_status,
    list_jobs,
)
from elasticrun.rendezvous.states import TERMINAL_PHASES, JobPhase
from elasticrun.store.client import EtcdStore, WatchEvent

HELP = """Show a job's round, members, ranks and recent rescale events (or list the jobs).

  elasticrun status --rdzv-endpoint etcd:2379 --rdzv-id job42            # one job
  elasticrun status --rdzv-endpoint etcd:2379 --rdzv-id job42 --watch    # live view until the job ends
  elasticrun status --rdzv-endpoint etcd:2379 --rdzv-id job42 --json     # one JSON document
  elasticrun status --rdzv-endpoint etcd:2379                            # every job in that etcd

With --watch --json, one JSON document per line is printed each time the job's keys change.
--watch of one job ends when the job ends; its exit code is then the job's outcome
(0 succeeded, 1 failed; a stopped job: its last node's code, 143 SIGTERM, 130 Ctrl-C).
Ctrl-C ends it earlier (exit 0); etcd unreachable for --timeout seconds ends it with 138.
"""

_MIN_REDRAW = 0.25  # seconds between redraws while watch events keep coming
_TICK = 1.0  # redraw of the rich view without events (ages, lease TTLs)
_LAST_READ_S = 1.0  # how long the read after a job's end (known from the watch) retries an unreachable etcd


# -- watching ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadHealth:
    """How a watch's reads of etcd have gone (pure: the caller passes the times).

    ``error``: what failed last (shown with the data; "" once a read and the watch work again);
    ``told``: the error already printed; ``failing_since``: when the reads or the watch began to fail.
    """

    error: str = ""
    told: str = ""
    failing_since: Optional[float] = None

    def after_read(self, fresh: bool, watching: bool, error: str, attempt: float) -> ReadHealth:
        """The health after a read at ``attempt`` (``fresh``: it succeeded; ``watching``: the etcd
        watch is up; ``error``: what failed this time, the read or the watch)."""
        if fresh and watching:
            return ReadHealth()
        return ReadHealth(error, self.told, self.failing_since if self.failing_since is not None else attempt)

    def to_tell(self) -> Optional[str]:
        """An error not yet printed (printed once, until it changes)."""
        return self.error if self.error and self.error != self.told else None

    def gave_up(self, now: float, give_up_after: Optional[float]) -> Optional[str]:
        """Why the watch stops (the StoreError's text) once the reads failed for ``give_up_after`` s."""
        if self.failing_since is None or give_up_after is None or now - self.failing_since < give_up_after:
            return None
        return f"{self.error or 'etcd does not answer'} (gave up after {give_up_after:g}s: --timeout)"


class _Subscription:
    """The etcd watch on ``prefix`` that wakes :func:`watch`: re-created when it died (etcd restarted)."""

    def __init__(self, store: EtcdStore, prefix: str,
                 on_events: Optional[Callable[[List[WatchEvent]], None]]) -> None:
        self.store, self.prefix, self.on_events = store, prefix, on_events
        self.changed = threading.Event()
        self.broken = threading.Event()
        self.cancel: Optional[Callable[[], None]] = None

    @property
    def watching(self) -> bool:
        return self.cancel is not None

    def _on_error(self, _err: BaseException) -> None:
        self.broken.set()
        self.changed.set()

    def _on_batch(self, events: List[WatchEvent]) -> None:
        if self.on_events is not None:
            self.on_events(events)
        self.changed.set()

    def ensure(self) -> str:
        """Watch (again) when there is no live watch; why that failed ("" when it did not)."""
        if self.cancel is not None and not self.broken.is_set():
            return ""
        self.close()
        self.broken.clear()
        try:
            self.cancel = self.store.watch_prefix(self.prefix, self._on_batch, self._on_error)
        except ElasticrunError as err:
            return str(err)
        return ""

    def wait_next(self, on_tick: bool) -> None:
        """Until a change (or a tick, ``on_tick``; or the watch is to be re-created), at most one redraw
        per ``_MIN_REDRAW`` s."""
        shown = time.monotonic()
        while True:
            fired = self.changed.wait(_TICK)
            if fired or on_tick or self.broken.is_set() or self.cancel is None:
                break
        pause = _MIN_REDRAW - (time.monotonic() - shown)
        if pause > 0:
            time.sleep(pause)
        self.changed.clear()

    def close(self) -> None:
        if self.cancel is not None:
            self.cancel()
            self.cancel = None


def watch(
    store: EtcdStore,
    prefix: str,
    snapshot: Callable[[], Any],
    show: Callable[[Any, str], None],
    on_tick: bool,
    initial: Any = None,
    until: Optional[Callable[[Any], bool]] = None,
    give_up_after: Optional[float] = None,
    on_events: Optional[Callable[[List[WatchEvent]], None]] = None,
) -> Any:
    """Call ``show(snapshot(), error)`` now and after every batch of changes under ``prefix``.

    Driven by an etcd watch (bursts are coalesced to one redraw per ``_MIN_REDRAW`` s; ``on_events``
    sees each batch first); with ``on_tick`` also once a second so ages and lease TTLs stay current.
    A dead watch (etcd restarted) is re-created; a failing read shows its error and is retried, for at
    most ``give_up_after`` seconds in a row (then StoreError). Returns the last snapshot on Ctrl-C, or
    once ``until(snapshot)`` is true (after showing it).
    """
    sub = _Subscription(store, prefix, on_events)
    last: Any = initial
    health = ReadHealth()
    try:
        while True:
            attempt = time.monotonic()  # a failing watch counts towards --timeout as a failing read does
            error = sub.ensure()
            fresh = False
            try:
                last, fresh = snapshot(), True
            except ElasticrunError as err:
                error = str(err)
            health = health.after_read(fresh, sub.watching, error, attempt)
            if last is not None and (fresh or on_tick):
                show(last, health.error)
            if fresh and until is not None and until(last):
                return last
            tell = health.to_tell()
            if tell is not None:
                err_console.print(Text(f"elasticrun: etcd: {tell} (retrying)"), highlight=False, soft_wrap=True)
                health = replace(health, told=tell)
            why = health.gave_up(time.monotonic(), give_up_after)
            if why is not None:
                raise StoreError(why)
            sub.wait_next(on_tick)
    except KeyboardInterrupt:
        return last
    finally:
        sub.close()


def _watch_rich(
    store: EtcdStore,
    prefix: str,
    snapshot: Callable[[], Any],
    render: Callable[[Any, str], RenderableType],
    **options: Any,
) -> Any:
    """A rich.live view on a terminal; elsewhere (a pipe, a log file) the view is printed again
    on every change, separated by a rule, so the output stays readable. ``options``: :func:`watch`'s."""
    if not console.is_terminal:

        def append(data: Any, error: str) -> None:
            console.rule(time.strftime("%H:%M:%S"))
            console.print(render(data, error))

        return watch(store, prefix, snapshot, append, on_tick=False, **options)
    with Live(Text("reading etcd ..."), console=console, auto_refresh=False) as live:
        return watch(store, prefix, snapshot, lambda d, err: live.update(render(d, err), refresh=True), True,
                     **options)


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
    store = settings.connect(JobKeys(rdzv_id).ping if rdzv_id else None, timeout=min(timeout, 5.0))
    try:
        if rdzv_id is None:
            _show_jobs(store, watch_, as_json, timeout)
        else:
            _show_job(store, rdzv_id, watch_, as_json, events, timeout)
    finally:
        store.close()


def _show_jobs(store: EtcdStore, watch_: bool, as_json: bool, timeout: float) -> None:
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
        watch(store, ROOT, snapshot, _json_line, on_tick=False, give_up_after=timeout)
        return
    _watch_rich(store, ROOT, snapshot, lambda d, err: Group(render_jobs(d["jobs"], endpoint), Text(err, style="red")),
                give_up_after=timeout)


def _show_job(store: EtcdStore, job: str, watch_: bool, as_json: bool, events: int, timeout: float) -> None:
    endpoint = store.endpoints
    doc = with_goodput(job_status(store, job, events=events))  # JobNotFoundError: one line, non-zero exit
    if not watch_ or ended(doc):
        if as_json and watch_:
            _json_line(doc, "")  # --watch --json prints JSON lines, the last one included
        elif as_json:
            print_json(doc)
        else:
            console.print(render_job(doc, endpoint))
        if watch_:
            raise typer.Exit(outcome(doc))
        return
    follow = _JobFollower(store, job, events, doc)
    options: Dict[str, Any] = dict(initial=doc, until=ended, give_up_after=timeout, on_events=follow.on_events)
    if as_json:
        last = watch(store, JobKeys(job).prefix, follow.snapshot, _json_line, on_tick=False, **options)
    else:
        last = _watch_rich(store, JobKeys(job).prefix, follow.snapshot, lambda d, err: render_job(d, endpoint, err),
                           **options)
    if last is not None and ended(last):
        raise typer.Exit(outcome(last))


class _JobFollower:
    """The documents of ``status --watch`` for one job. The job's end also comes with the watch event
    that carries its ``state``: when etcd is gone before it could be read (a ``--standalone`` job's
    private etcd stops as its agent exits), the last document with that end is the watch's last."""

    def __init__(self, store: EtcdStore, job: str, events: int, doc: Dict[str, Any]) -> None:
        self.store = store
        self.job = job
        self.keys = JobKeys(job)
        self.events = events
        self.last = doc
        self.end: Optional[Dict[str, Any]] = None  # the job's state, from a watch event

    def on_events(self, events: List[WatchEvent]) -> None:
        for ev in events:
            if ev.key == self.keys.state and not ev.deleted:
                self.end = records.parse(ev.key, ev.value, records.state_record) or self.end

    def snapshot(self) -> Dict[str, Any]:
        patience = self.store.retry_timeout
        if self.end is not None:  # the watch brought the end: its etcd may be gone with it (--standalone)
            self.store.retry_timeout = min(patience, _LAST_READ_S)
        try:
            self.last = with_goodput(job_status(self.store, self.job, events=self.events))
        except JobNotFoundError:
            if self.end is not None:  # ended, and its keys removed since (a new job took the id)
                return self._final()
            gone = build_job_status(self.job, [], 0, None, self.events)
            gone["phase"] = JobPhase.GONE.value
            return gone
        except StoreError:
            if self.end is None:
                raise
            return self._final()
        finally:
            self.store.retry_timeout = patience
        return self.last

    def _final(self) -> Dict[str, Any]:
        """The last document read, with the end the watch was sent."""
        final = dict(self.last, state=self.end)
        final["phase"] = job_phase(final)
        return final


def ended(doc: Dict[str, Any]) -> bool:
    """Has the job of status document ``doc`` ended (succeeded, failed or stopped)?"""
    return doc.get("phase") in TERMINAL_PHASES


def outcome(doc: Dict[str, Any]) -> int:
    """The exit code of ``status --watch`` for an ended job: 0 succeeded, 1 failed; a stopped job's
    recorded code (its last node's: 143 drained by SIGTERM, 130 by Ctrl-C, 138 gave up waiting), else 1."""
    if doc.get("phase") == JobPhase.SUCCEEDED:
        return 0
    code = (doc.get("state") or {}).get("exit_code")
    if doc.get("phase") == JobPhase.STOPPED and isinstance(code, int) and not isinstance(code, bool):
        return code
    return 1


__all__ = ["HELP", "status", "watch"]
