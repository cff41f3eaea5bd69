"""Straggler detection in the agent: the leader scores every rank, every agent acts on its own node's score.

Once a second (a daemon thread, never in the round loop):

- **the leader** reads ``progress/`` (every node's report carries its ranks' mean compute seconds per step,
  :mod:`elasticrun.train.steptime`), scores the ranks of the current round
  (:class:`~elasticrun.health.straggler.StragglerTracker`), decides a drain
  (:func:`~elasticrun.health.straggler.drain_decision`, only with ``--straggler-action drain``) and writes
  ``health/stragglers`` when a flag or the drain changes, and every :data:`REWRITE_S` seconds (so that
  ``status`` shows current ratios);
- **every agent** reads that record from its job view (no etcd call): its node's flag and ratio go to
  metrics and events, the job's worst ratio to goodput (cause ``straggler``), and a drain naming its node
  to :meth:`StragglerWatch.drain_reason`, which the round loop turns into a graceful leave.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from elasticrun.errors import ElasticrunError
from elasticrun.health.straggler import (
    Assessment,
    Reading,
    StragglerAction,
    StragglerPolicy,
    StragglerTracker,
    drain_decision,
)
from elasticrun.job import records
from elasticrun.job.keys import last_part
from elasticrun.launch.config import LaunchConfig
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import Topology

POLL_S = 1.0
REWRITE_S = 5.0


class Drained(Exception):
    """``--straggler-action drain`` named this node: the agent leaves the job as on SIGTERM, and exits 6."""

    signum = int(signal.SIGTERM)  # what its workers get, as on a SIGTERM

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def readings(kvs: List[Any], round_: int) -> List[Reading]:
    """The ranks' compute figures in the progress reports ``kvs`` of round ``round_`` (closed ones left out)."""
    out: List[Reading] = []
    for kv in kvs:
        rec = records.read(kv, records.progress_record)
        if rec is None or rec.get("round") != round_ or rec.get("closed"):
            continue
        at = rec.get("time")
        for rank, seconds in (rec.get("compute") or {}).items():
            try:
                out.append(Reading(int(rank), last_part(kv.key), float(seconds), float(at or 0.0)))
            except (TypeError, ValueError):
                continue
    return out


def record_of(a: Assessment, policy: StragglerPolicy, drain: List[str], now: float) -> Dict[str, Any]:
    """The ``health/stragglers`` record of assessment ``a``."""
    return {"round": a.round, "time": now, "threshold": policy.threshold, "window_s": policy.window_s,
            "median_s": a.median_s, "ranks": {str(r): s.to_dict() for r, s in sorted(a.ranks.items())},
            "nodes": {n: round(v, 3) for n, v in sorted(a.nodes.items())}, "drain": drain}


class StragglerWatch:
    """See the module docstring. ``on_score(mine, ratio, ranks, job_ratio)`` gets this node's state each tick."""

    def __init__(self, cfg: LaunchConfig, rdzv: Rendezvous, say: Callable[[str], None],
                 on_score: Callable[[bool, Optional[float], Dict[str, float], Optional[float]], None]) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.say = say
        self.on_score = on_score
        self.policy = StragglerPolicy(threshold=cfg.health.straggler_threshold, window_s=cfg.health.straggler_window)
        self.tracker = StragglerTracker(self.policy)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._drain: Optional[tuple] = None  # (round, reason) once the leader drains this node
        self._written: Optional[tuple] = None  # (round, nodes, drain) last written
        self._written_at = 0.0
        self._drained: Dict[int, List[str]] = {}  # round -> nodes the leader drained in it

    def start(self) -> StragglerWatch:
        threading.Thread(target=self._run, name="elasticrun-stragglers", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()

    def drain_reason(self, round_: int) -> Optional[str]:
        """Why this node must leave the job now (None: it stays)."""
        with self._lock:
            return self._drain[1] if self._drain is not None and self._drain[0] == round_ else None

    def _run(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                self.tick(time.time())
            except (ElasticrunError, ValueError, TypeError):
                continue  # etcd trouble or a bad record: the next tick tries again

    def tick(self, now: float) -> None:
        topo, _ = self.rdzv.view.topology()
        if topo is None:
            return
        if self.rdzv.leadership.holder() == self.cfg.rendezvous.node_id:
            self._lead(topo, now)
        self._follow(topo)

    def _lead(self, topo: Topology, now: float) -> None:
        kvs, _ = self.rdzv.store.get_prefix(self.rdzv.keys.progress)
        a = self.tracker.observe(topo.round, readings(kvs, topo.round), now)
        members = [m.node_id for m in topo.members]
        drained = self._drained.setdefault(topo.round, [])
        decision = drain_decision(a, self.cfg.health.straggler_action, members, self.cfg.rendezvous.nnodes_min, drained)
        if decision.node is not None:
            drained.append(decision.node)
            self.say(f"round {topo.round}: draining node {decision.node} ({decision.reason})")
        for node in a.flagged:
            self.say(f"round {topo.round}: node {node} is a straggler: compute {a.nodes[node]:.2f}× the job's median "
                     f"for {self.policy.window_s:g} s"
                     + ("" if self.cfg.health.straggler_action is StragglerAction.DRAIN
                        else " (--straggler-action warn)"))
        for node in a.cleared:
            self.say(f"round {topo.round}: node {node} is no longer a straggler")
        if decision.reason and decision.node is None and a.flagged:
            self.say(f"round {topo.round}: not draining: {decision.reason}")
        key = (topo.round, tuple(sorted(a.nodes)), tuple(drained))
        if key != self._written or now - self._written_at >= REWRITE_S:
            self.rdzv.store.put_json(self.rdzv.keys.stragglers, record_of(a, self.policy, list(drained), now))
            self._written, self._written_at = key, now

    def _follow(self, topo: Topology) -> None:
        rec = self.rdzv.view.record(self.rdzv.keys.stragglers, records.straggler_record)
        me = self.cfg.rendezvous.node_id
        if rec is None or rec["round"] != topo.round:
            self.on_score(False, None, {}, None)
            return
        nodes = rec.get("nodes") or {}
        mine = {r: float(row.get("compute_s", 0.0)) for r, row in (rec.get("ranks") or {}).items()
                if row.get("node") == me}
        ratios = [float(row["ratio"]) for row in (rec.get("ranks") or {}).values() if row.get("node") == me]
        self.on_score(me in nodes, max(ratios, default=None), mine, max(nodes.values(), default=None))
        if me in (rec.get("drain") or []):
            with self._lock:
                if self._drain is None or self._drain[0] != topo.round:
                    self._drain = (topo.round, f"drained as a straggler (compute {nodes.get(me, 0.0):.2f}× "
                                               "the job's median, --straggler-action drain)")


__all__ = ["Drained", "StragglerWatch", "readings", "record_of"]
