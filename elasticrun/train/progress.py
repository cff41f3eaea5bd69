"""Training progress in etcd, for ``elasticrun status``.

The node's local rank 0 writes ``/elasticrun/<job>/progress/<node-id>`` =
``{"step", "loss", "samples_per_s", "rank", "round", "world_size", "time", "stalls"}`` (and
``"closed": true`` in the last report, written by :meth:`ProgressReporter.close`), and ``"compute"``
(every local rank's mean compute seconds per step, by rank, when the script times its steps:
:mod:`elasticrun.train.steptime`) under its own short lease (refreshed with every write), at most once
per ``interval`` seconds. After a restart it also carries ``"restored"`` (the step
:func:`~elasticrun.train.load_latest` resumed from in this round) and ``"reached"`` (the last step
the previous round's reporter on this node recorded in its :class:`StepFile`): the agent counts
the steps a rollback lost as reached − restored, exactly, not from reports up to a second apart.
After an in-place re-form (:class:`~elasticrun.train.InPlace`) every reporter of the process,
:func:`heartbeat`'s included, reports the new round, rank and world size (:func:`follow_reform`):
the agent judges hangs and counts goodput by the round it runs.
When the worker stops reporting (it exited, hung or died) the key vanishes after the
lease TTL. ``stalls`` (:meth:`ProgressReporter.stalled`) holds this worker's cumulative
checkpoint and snapshot stalls, ``{"checkpoint": [count, seconds, last], ...}``, which the agent
turns into goodput accounting and duration histograms. :meth:`ProgressReporter.report` never
blocks on etcd: a background thread does the writing, and an unreachable etcd only costs one warning.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from elasticrun.errors import ElasticrunError
from elasticrun.job import env as env_names
from elasticrun.train import steptime
from elasticrun.train.env import ElasticState
from elasticrun.train.etcdlink import EtcdLink

log = logging.getLogger(__name__)

PROGRESS_DIR = "progress/"


class ProgressReporter:
    """Throttled, lease-attached progress reports from a node's local rank 0."""

    def __init__(
        self,
        state: Optional[ElasticState] = None,
        *,
        interval: float = 1.0,
        ttl: int = 10,
        endpoint: Optional[str] = None,
        job_id: Optional[str] = None,
    ) -> None:
        if state is not None and hasattr(state, "state"):  # an ElasticContext
            state = state.state
        self.state = state or ElasticState.from_env()
        self.interval = interval
        self.ttl = max(2, int(ttl))
        self.link = EtcdLink(
            self.state.rdzv_endpoint if endpoint is None else endpoint,
            self.state.rdzv_id if job_id is None else job_id,
            "progress reports",
        )
        self.key = self.link.keys.progress_of(self.state.progress_id)
        self.active = self.link.enabled and self.state.is_local_rank0
        self._steps = StepFile.of_env() if self.active else None
        self._reached = self._steps.previous(self.state.round) if self._steps is not None else None
        self.puts = 0
        self._latest: Optional[Dict[str, Any]] = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._lease: Optional[int] = None
        self._last_rate: Optional[tuple] = None  # (time, samples)
        self._stalls: Dict[str, List[float]] = {}  # kind -> [count, total seconds, last seconds]
        self._last_report: Optional[Dict[str, Any]] = None  # the latest report (written or queued)
        self._thread: Optional[threading.Thread] = None
        if self.active:
            self._thread = threading.Thread(target=self._run, name="elasticrun-progress", daemon=True)
            self._thread.start()
        _LIVE.add(self)

    def follow(self, state: ElasticState) -> None:
        """Report as a worker of ``state`` from now on (an in-place re-form: same process, new round).
        A re-form loses no step: ``reached``/``restored`` of the old round no longer apply."""
        self.state = state
        self._reached = None

    def report(
        self, step: int, loss: Optional[float] = None, samples_per_s: Optional[float] = None, *,
        samples: Optional[int] = None,
    ) -> None:
        """Record the latest progress (never blocks). ``samples`` (a running global count) lets
        the reporter compute ``samples_per_s`` itself."""
        if not self.active:
            return
        now = time.time()
        if samples_per_s is None and samples is not None:
            if self._last_rate is not None and now > self._last_rate[0]:
                samples_per_s = (samples - self._last_rate[1]) / (now - self._last_rate[0])
            if self._last_rate is None or now - self._last_rate[0] >= self.interval:
                self._last_rate = (now, samples)
        value = {
            "step": int(step),
            "loss": None if loss is None or not math.isfinite(float(loss)) else float(loss),
            "samples_per_s": None if samples_per_s is None else round(float(samples_per_s), 3),
            "rank": self.state.rank,
            "round": self.state.round,
            "world_size": self.state.world_size,
            "time": now,
        }
        if self._stalls:
            value["stalls"] = {k: [int(v[0]), round(v[1], 4), round(v[2], 4)] for k, v in self._stalls.items()}
        compute = compute_times(self.state.round, self.state.rank)
        if compute:
            value["compute"] = compute
        if _RESTORED is not None and _RESTORED[0] == self.state.round:
            value["restored"] = _RESTORED[1]
        if self._reached is not None:
            value["reached"] = self._reached
        if self._steps is not None:
            self._steps.write(self.state.round, int(step))
        with self._lock:
            self._latest = self._last_report = value
        self._wake.set()

    def stalled(self, kind: str, seconds: float) -> None:
        """Training was blocked ``seconds`` by a ``kind`` ("checkpoint" or "snapshot") save; sent with the
        next :meth:`report` (goodput accounting and the agent's ``elasticrun_checkpoint_seconds``)."""
        entry = self._stalls.setdefault(kind, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += max(0.0, float(seconds))
        entry[2] = max(0.0, float(seconds))
        with self._lock:
            last = self._last_report
        if last is not None:  # re-send the latest report with it: a worker that exits now still tells
            self.report(last["step"], last["loss"], last["samples_per_s"])

    def close(self, timeout: float = 2.0) -> None:
        """Write the last report, marked ``"closed": true`` (best effort, at most ``timeout`` s), and
        stop: ``--hang-timeout`` no longer judges this node's steps. The key then expires with its lease."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.link.close()

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        last_put = 0.0
        while True:
            self._wake.wait()
            closing = self._closed.is_set()
            wait = self.interval - (time.monotonic() - last_put)
            if wait > 0 and not closing:
                self._closed.wait(wait)  # throttle; a close cuts the wait short
                closing = self._closed.is_set()
            self._wake.clear()
            with self._lock:
                value, self._latest = self._latest, None
            if closing and (value or self._last_report) is not None:
                value = dict(value or self._last_report or {}, closed=True)  # the end of training, not a hang
            if value is not None:
                self._put(value)
                last_put = time.monotonic()
            if closing:
                return

    def _put(self, value: Dict[str, Any]) -> None:
        store = self.link.store()
        if store is None:
            self._lease = None
            return
        try:
            if self._lease is not None and store.refresh_lease(self._lease) <= 0:
                self._lease = None
            if self._lease is None:
                self._lease = store.grant_lease(self.ttl)
            store.put_json(self.key, value, lease=self._lease)
            self.puts += 1
        except ElasticrunError as err:
            self._lease = None
            self.link.failed(err)


class StepFile:
    """The node's record of its reporter's latest step (``ELASTICRUN_PROGRESS_FILE``, the agent's
    file, kept across rounds): ``<round> <step>``, rewritten in place at every report (one
    ``pwrite``, no etcd), so the next round's reporter knows how far the previous one got even
    when it died between two reports to etcd."""

    WIDTH = 48  # fixed: a rewrite never leaves the tail of a longer one

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: Optional[int] = None

    @classmethod
    def of_env(cls) -> Optional[StepFile]:
        path = os.environ.get(env_names.PROGRESS_FILE, "").strip()
        return cls(path) if path else None

    def previous(self, current_round: int) -> Optional[int]:
        """The step recorded by a reporter of an earlier round than ``current_round`` (None if none)."""
        try:
            with open(self.path, "rb") as f:
                fields = f.read(self.WIDTH).split()
            rnd, step = int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):
            return None
        return step if rnd < current_round and step >= 0 else None

    def write(self, round_: int, step: int) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.pwrite(self._fd, f"{round_} {step}".ljust(self.WIDTH - 1).encode()[:self.WIDTH - 1] + b"\n", 0)
        except OSError:
            self._fd = None  # best effort: the agent then counts from the reports it saw


def compute_times(round_: int, rank: int) -> Dict[str, float]:
    """Every local rank's mean compute seconds per step (:mod:`elasticrun.train.steptime`), by rank as text
    (JSON keys); {} when the script times no steps."""
    found = steptime.node_step_times(round_)
    timer = steptime.current()
    mean = timer.mean() if timer is not None else None
    if mean is not None:
        found[rank] = mean  # our own, fresher than our file
    return {str(r): round(v, 6) for r, v in sorted(found.items())}


_RESTORED: Optional[Tuple[int, int]] = None  # (round, step) of this process's latest restore
_LIVE: weakref.WeakSet[ProgressReporter] = weakref.WeakSet()  # every reporter of this process


def follow_reform(state: ElasticState) -> None:
    """This process re-formed in place into ``state``'s round: every reporter reports that round."""
    for reporter in list(_LIVE):
        reporter.follow(state)


def note_restored(step: Optional[int]) -> None:
    """Record that this process resumed from a checkpoint of training step ``step`` (called by
    :func:`elasticrun.train.load_latest`): the round's reports carry it as ``restored``, so the
    agent counts the steps a rollback lost from there."""
    global _RESTORED
    if step is None:
        return
    try:
        _RESTORED = (ElasticState.from_env().round, int(step))
    except ElasticrunError:  # not launched as a worker (its environment is incomplete): nobody to tell
        return


_HEARTBEAT: Optional[ProgressReporter] = None
_heartbeat_lock = threading.Lock()


def heartbeat(step: int, loss: Optional[float] = None) -> None:
    """Report ``step`` (and ``loss``) with a process-wide :class:`ProgressReporter`, made on first use.

    One call per training step is all an unmodified script needs for ``elasticrun status`` and for
    ``--hang-timeout`` (a step that stops changing means a hang). Never blocks; a no-op outside
    elasticrun and on ranks other than a node's local rank 0.
    """
    global _HEARTBEAT
    if _HEARTBEAT is None:
        with _heartbeat_lock:
            if _HEARTBEAT is None:
                _HEARTBEAT = ProgressReporter()
                atexit.register(_HEARTBEAT.close)  # the script's end (teardown, last saves) is no hang
    _HEARTBEAT.report(step, loss)


__all__ = ["PROGRESS_DIR", "ProgressReporter", "StepFile", "follow_reform", "heartbeat", "note_restored"]
