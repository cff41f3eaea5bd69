"""What the agent tells the outside world about itself: metrics, goodput, events.

The agent calls a few hooks at its phase transitions (:meth:`Observer.rendezvous`,
:meth:`round_started`, :meth:`round_failed`, :meth:`round_changed`, :meth:`tick`,
:meth:`finish`); a daemon thread reads this node's progress key once a second (step,
rate, checkpoint stalls) and publishes the goodput accounting to etcd (``goodput/<node>``,
on the agent's lease) every :data:`PUBLISH_S` seconds and at phase changes; the final one, when
the job ends, stays (like the job's terminal state). Nothing here
ever raises into the agent loop once started: etcd errors only delay the next report.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

from elasticrun.errors import ElasticrunError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.events import EventKind, EventLog
from elasticrun.launch.goodput import Cause, Goodput, Phase, rollback_marks
from elasticrun.launch.metrics import Metrics
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import RescaleEvent, RescaleType, Topology
from elasticrun.store.client import EtcdStore
from elasticrun.store.lease import LeaseHealth

POLL_S = 1.0  # reads of our node's progress key
PUBLISH_S = 10.0  # goodput accounting to etcd, besides phase changes
_LEASE = {LeaseHealth.HELD: "held", LeaseHealth.IN_DOUBT: "in_doubt", LeaseHealth.LOST: "lost"}


def recovery(topo: Topology) -> str:
    """How round ``topo`` recovers from a failure: ``in_place`` (some nodes kept their workers) or ``restart``."""
    return "in_place" if topo.inplace else "restart"


class Observer:
    """One agent's metrics endpoint, goodput accounting, event log and etcd report."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.keys = JobKeys(cfg.rendezvous.rdzv_id)
        self._lock = threading.Lock()
        self.goodput = Goodput()
        self.events = EventLog(cfg.logs.events_file, cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id)
        self.state: Dict[str, Any] = {"round": -1, "world_size": 0, "nodes": 0, "restarts": 0, "rescales": {},
                                      "recoveries": {}, "role": "member", "lease": "lost", "samples_per_s": None}
        self.metrics = (Metrics(cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id, self.snapshot)
                        if cfg.logs.metrics_port else None)
        self.port: Optional[int] = None
        self._store: Optional[EtcdStore] = None
        self._lease_id: Optional[int] = None
        self._stalls: Dict[str, List[float]] = {}  # the round's last seen [count, total, last] per kind
        self._publish = threading.Event()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._outage = False
        self._seen: Any = None  # the "time" of the progress report read last

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> Optional[int]:
        """Serve /metrics (if asked); the port bound. ConfigError when it cannot listen."""
        if self.metrics is not None:
            self.port = self.metrics.serve(self.cfg.logs.metrics_host, self.cfg.logs.metrics_port)
        return self.port

    def attach(self, store: EtcdStore) -> None:
        """Start timing etcd calls and the progress/report thread on ``store``."""
        self._store = store
        if self.metrics is not None:
            store.on_call = self.metrics.observe_etcd
        self._thread = threading.Thread(target=self._run, name="elasticrun-observe", daemon=True)
        self._thread.start()

    def detach(self, wait: float = 5.0) -> None:
        """Stop the progress/report thread and the etcd timing (before the store closes), waiting up to
        ``wait`` s for its last report (0 when etcd is failing: a call in flight would hold the exit)."""
        self._closed.set()
        self._publish.set()
        if self._thread is not None and wait > 0:
            self._thread.join(wait)
        if self._store is not None:
            self._store.on_call = None
            self._store = None

    def close(self) -> None:
        """Stop serving /metrics and close the event log (the agent's very last step)."""
        self.detach()
        if self.metrics is not None:
            self.metrics.close()
        self.events.close()

    # -- hooks (agent loop) ---------------------------------------------------------------------

    def rendezvous(self, rdzv: Rendezvous) -> None:
        """The agent is forming a round."""
        self._see(rdzv)
        self._enter(Phase.RENDEZVOUS)

    def round_started(self, topo: Topology, event: Optional[RescaleEvent]) -> None:
        """Round ``topo`` formed: our workers start now."""
        kind = event.type if event is not None else RescaleType.START
        with self._lock:
            s = self.state
            # A worker failure's recovery: a restart, or a smaller round the crashed node sits out
            recovered = kind is RescaleType.RESTART or (event is not None and event.recovers)
            s.update(round=topo.round, world_size=topo.world_size, nodes=len(topo.members),
                     restarts=topo.restart_count)
            if kind not in (RescaleType.START, RescaleType.RESTART):
                s["rescales"][kind.value] = s["rescales"].get(kind.value, 0) + 1
            how = recovery(topo)
            if recovered:
                s["recoveries"][how] = s["recoveries"].get(how, 0) + 1
            self._stalls = {}
            self.goodput.enter(Phase.STARTING)
        self.events.emit(EventKind.ROUND_FORMED, round=topo.round, world_size=topo.world_size,
                         nodes=len(topo.members), type=kind.value, restarts=topo.restart_count)
        if recovered:
            self.events.emit(EventKind.RESTART, round=topo.round, restarts=topo.restart_count, recovery=how)
        if kind not in (RescaleType.START, RescaleType.RESTART):
            self.events.emit(EventKind.RESCALE, round=topo.round, type=kind.value,
                             old_world_size=event.old_world_size if event else None, new_world_size=topo.world_size,
                             recovery=how)
        self._publish.set()

    def round_failed(self) -> None:
        """A worker failed: the round is stopping for a restart."""
        self._enter(Phase.RESTARTING, Cause.RESTART)

    def hang(self, topo: Topology, step: Optional[int], stalled_s: float) -> None:
        """``--hang-timeout`` fired on our node: a ``hang`` event; the stalled time and the restart
        after it are badput of cause ``hang`` (see launch/goodput.py)."""
        with self._lock:
            self.goodput.hang()
        self.events.emit(EventKind.HANG, round=topo.round, step=step, stalled_s=round(stalled_s, 3))
        self._publish.set()

    def node_checking(self) -> None:
        """``--node-check`` starts: its time is badput of cause ``node_check``."""
        self._enter(Phase.RENDEZVOUS, Cause.NODE_CHECK)

    def node_checked(self, report: Any) -> None:
        """``--node-check`` ended (a :class:`elasticrun.health.node.NodeReport`): a ``node_check`` event."""
        self._enter(Phase.RENDEZVOUS, Cause.STARTUP)
        self.events.emit(EventKind.NODE_CHECK, passed=report.passed, reason=report.reason,
                         failed=[c.to_dict() for c in report.checks if c.failed])

    def straggler_score(self, mine: bool, ratio: Optional[float], ranks: Dict[str, float],
                        job_ratio: Optional[float]) -> None:
        """The leader's latest scores: this node a straggler (``mine``, its worst ``ratio``), its ranks' compute
        seconds per step, and the job's worst straggler ratio (goodput: cause ``straggler``)."""
        with self._lock:
            was = self.state.get("straggler", False)
            self.state.update(straggler=mine, straggler_ratio=ratio, rank_compute=dict(ranks))
            self.goodput.slowed(job_ratio)
        if mine != was:
            self.events.emit(EventKind.STRAGGLER, straggler=mine, ratio=ratio, round=self.state["round"])

    def drained(self, reason: str) -> None:
        """This node leaves the job as a straggler: a ``drained`` event; the re-forming is cause ``drain``."""
        self._enter(Phase.RESCALING, Cause.DRAIN)
        self.events.emit(EventKind.DRAINED, reason=reason, round=self.state["round"])

    def round_changed(self, rdzv: Rendezvous, topo: Topology) -> None:
        """Round ``topo`` ended for another reason than our workers: another node's worker failed
        (a restart) or the membership changed (a rescale)."""
        if rdzv.round_failed(topo.round):
            self._enter(Phase.RESTARTING, Cause.RESTART)
        else:
            drained = rdzv.view.record(rdzv.keys.stragglers, records.straggler_record)
            by_drain = drained is not None and drained.get("round") == topo.round and bool(drained.get("drain"))
            self._enter(Phase.RESCALING, Cause.DRAIN if by_drain else Cause.RESCALE)

    def tick(self, rdzv: Rendezvous, outage: bool) -> None:
        """Each turn of the round loop: lease state, role, and outage begin/end."""
        self._see(rdzv)
        with self._lock:
            if outage == self._outage:
                return
            self._outage = outage
            self.goodput.outage(outage)
        self.events.emit(EventKind.OUTAGE_BEGIN if outage else EventKind.OUTAGE_END)

    def _see(self, rdzv: Rendezvous) -> None:
        lease = rdzv.lease
        self._lease_id = None if lease is None else lease.lease_id
        leader = rdzv.leadership.holder() == self.cfg.rendezvous.node_id
        with self._lock:
            self.state.update(lease=_LEASE.get(rdzv.lease_health(), "lost"), role="leader" if leader else "member")

    def finish(self, outcome: str) -> None:
        """The job ended (``succeeded``/``failed``): the workers' last progress report is read (a save
        reported just before they exited counts), the accounting stops; one last report."""
        self._poll_progress()
        with self._lock:
            self.goodput.finish()
        self.events.emit(EventKind.JOB_ENDED, outcome=outcome, goodput=self.summary())
        self._report(final=True)

    # -- reading --------------------------------------------------------------------------------

    def summary(self) -> Dict[str, Any]:
        with self._lock:
            return self.goodput.summary()

    def snapshot(self) -> Dict[str, Any]:
        """Everything the metrics collector shows (a copy, taken under the lock)."""
        with self._lock:
            doc = dict(self.state, rescales=dict(self.state["rescales"]), recoveries=dict(self.state["recoveries"]))
            doc.update(self.goodput.summary())
            doc["counters"] = self.goodput.counters()
        return doc

    # -- the thread -----------------------------------------------------------------------------

    def _enter(self, phase: Phase, cause: Optional[Cause] = None) -> None:
        with self._lock:
            self.goodput.enter(phase, cause)
        self._publish.set()

    def _run(self) -> None:
        next_publish = 0.0
        while not self._closed.is_set():
            self._poll_progress()
            if self._publish.is_set() or time.monotonic() >= next_publish:
                self._publish.clear()
                self._report()
                next_publish = time.monotonic() + PUBLISH_S
            self._publish.wait(POLL_S)

    def _poll_progress(self) -> None:
        store = self._store
        if store is None:
            return
        try:
            p = records.read(store.get(self.keys.progress_of(self.cfg.rendezvous.node_id)), records.progress_record)
        except ElasticrunError:
            return
        if not isinstance(p, dict) or "step" not in p or p.get("time") == self._seen:
            return  # nothing new
        self._seen = p.get("time")
        committed: List[Dict[str, Any]] = []
        with self._lock:
            if p.get("round") != self.state["round"]:
                return  # a report of a round that ended (or one our agent has not seen start yet)
            stalls = p.get("stalls") if isinstance(p.get("stalls"), dict) else {}
            stall_s = sum(float(v[1]) for v in stalls.values() if isinstance(v, list) and len(v) == 3)
            try:
                at = time.monotonic() - max(0.0, time.time() - float(p.get("time") or time.time()))
            except (TypeError, ValueError):
                at = None
            phase = self.goodput.phase
            self.goodput.report(int(p["step"]), stall_s, at, **rollback_marks(p))
            if self.goodput.phase is not phase:
                self._publish.set()  # the round's first report: ``status`` shows training from now on
            self.state["samples_per_s"] = p.get("samples_per_s")
            for kind, value in stalls.items():
                if not isinstance(value, list) or len(value) != 3:
                    continue
                seen = self._stalls.get(kind, [0, 0.0, 0.0])
                new = int(value[0]) - int(seen[0])
                if new > 0:
                    self._observe(kind, new, float(value[1]) - float(seen[1]), float(value[2]))
                    if kind == "checkpoint":
                        committed.append({"step": p["step"], "seconds": value[2], "round": p.get("round")})
                self._stalls[kind] = list(value)
        for c in committed:
            self.events.emit(EventKind.CHECKPOINT_COMMITTED, **c)

    def _observe(self, kind: str, count: int, total: float, last: float) -> None:
        """``count`` new saves of ``kind`` took ``total`` s, the last one ``last`` s (histograms)."""
        if self.metrics is None:
            return
        hist = self.metrics.checkpoint if kind == "checkpoint" else self.metrics.snapshot
        if count > 1:
            for _ in range(count - 1):
                hist.observe(max(0.0, total - last) / (count - 1))
        hist.observe(last)

    def _report(self, final: bool = False) -> None:
        """Put our accounting on our lease; the ``final`` one (the job ended) without a lease, so that
        ``status`` of a finished job still shows its goodput, like its terminal state."""
        store, lease = self._store, self._lease_id
        if store is None or (lease is None and not final):
            return
        try:
            store.put_json(self.keys.goodput_of(self.cfg.rendezvous.node_id), dict(self.summary(), time=time.time()),
                           lease=None if final else lease)
        except ElasticrunError:
            pass  # etcd or our lease is gone for now: the next report tries again


__all__ = ["Observer", "recovery"]
