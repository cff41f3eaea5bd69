"""The rendezvous while a round runs: why it ends, scale-up after the stability window, reports.

A mixin of :class:`elasticrun.rendezvous.protocol.Rendezvous` (split out to keep modules small):
it reads the job through the agent's :class:`~elasticrun.rendezvous.view.JobView`. Only the
leader (:mod:`elasticrun.rendezvous.leader`) sees the node records, so it is the one that ends a
round for a lost member or for newcomers; the others learn it from ``rounds/<n>/end``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from elasticrun.errors import StoreError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.leader import Leadership
from elasticrun.rendezvous.records import RescaleEvent, Topology, event_record
from elasticrun.rendezvous.states import JobState, RoundOutcome
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import EtcdStore

log = logging.getLogger(__name__)


class RoundMonitor:
    """Round-time methods of the rendezvous (see the module doc)."""

    store: EtcdStore
    keys: JobKeys
    view: JobView
    settings: Any  # RendezvousSettings
    node_id: str
    _say: Callable[[str], None]
    _newcomers_since: Optional[float]
    _members_checked: Optional[Tuple[int, int]]
    _quiet_since: Optional[Tuple[int, int]] = None  # (round, view.job_version) when it was last found running
    leadership: Leadership

    def leading(self) -> bool:  # pragma: no cover - provided by Rendezvous
        raise NotImplementedError

    def recently_unreachable(self) -> bool:  # pragma: no cover - provided by Rendezvous
        raise NotImplementedError

    def _end_job(self, state: JobState, reason: str, topo: Topology, topo_rev: int,  # pragma: no cover
                 exit_code: Optional[int] = None) -> None:
        raise NotImplementedError

    def view_version(self) -> int:
        """The view's version that :meth:`wait_view` waits on (see there)."""
        return self.view.version if self.leadership.leads else self.view.job_version

    def wait_view(self, since: int, timeout: float) -> int:
        """Wait for a change of the view that matters to us (or ``timeout``); the new :meth:`view_version`.

        The leader wakes on every change; the others not on node records alone (which a view shared
        by several agents, as in the bench, would otherwise deliver to each of them).
        """
        return self.view.wait_change(since, timeout, nodes=self.leadership.leads)

    def rescale_event(self, round_: int) -> Optional[RescaleEvent]:
        """The event that formed round ``round_`` (None when absent or malformed)."""
        key = self.keys.event(round_)
        kv = self.view.get(key)
        if kv is None:
            # Written in the round's transaction, but a view without the node records watches
            # events/ and the topology on separate ranges: the topology may have come first.
            try:
                kv = self.store.get(key)
            except StoreError as err:
                log.warning("could not read the rescale event of round %d: %s", round_, err)
        return records.read(kv, event_record)

    def round_failed(self, round_: int) -> bool:
        """Whether round ``round_`` has its failure flag (a malformed one counts as absent)."""
        return self.view.record(self.keys.failed(round_), records.failed_flag) is not None

    def round_change(self, topo: Topology) -> Optional[str]:
        """Why round ``topo`` is over (None while it runs); RoundOutcome.SUCCEEDED when every member finished."""
        # A node that does not lead learns everything from the job's keys: while they did not change
        # since we last found the round running, it still runs (no lookups at each turn of our loop).
        quiet = (topo.round, self.view.job_version)
        if quiet == self._quiet_since and not self.leadership.leads:
            return None
        why = self._round_change(topo)
        self._quiet_since = quiet if why is None else None
        return why

    def _round_change(self, topo: Topology) -> Optional[str]:
        state = self.view.state()
        if state:
            return f"job {state.get('state')}"
        current, _ = self.view.topology()
        if current is None or current.round != topo.round:
            return "a newer round was formed"
        # A malformed flag is reported once and counts as absent (the next writer replaces it).
        failed = self.view.record(self.keys.failed(topo.round), records.failed_flag)
        if failed is not None:
            return f"worker failure on {failed.get('node', '?')}"
        end = self.view.record(self.keys.end(topo.round), records.end_flag)
        if end is not None:
            return str(end.get("reason", "round ended"))
        # Only the leader sees the node records: it ends the round for everyone. It looks at them
        # only when a record appeared, vanished or changed its lease (not for each Active report).
        if self.leading() and self._members_checked != (topo.round, self.view.members_version):
            checked = (topo.round, self.view.members_version)
            nodes = self.view.nodes()
            members = current.members  # the same round; a member may have rejoined after an outage (new lease)
            for m in members:
                entry = nodes.get(m.node_id)
                if entry is None or entry[1] != m.lease:
                    if self.recently_unreachable():
                        checked = None  # look again: the member may still come back
                        continue  # after an etcd outage every lease may have expired: let members rejoin
                    reason = f"node {m.node_id} left or lost its lease"
                    record = {"reason": reason, "by": self.node_id, "lost": m.node_id, "time": time.time()}
                    self.create_flag(self.keys.end(topo.round), record, records.end_flag)
                    return reason
            self._members_checked = checked
        if len(self.view.under(self.keys.dones(topo.round))) >= len(topo.members):
            return RoundOutcome.SUCCEEDED
        return None

    def scale_up_pending(self, topo: Topology) -> bool:
        """True once the leader saw a newcomer: round ``topo`` ends within a stability window."""
        return self._newcomers_since is not None or self.view.get(self.keys.joining(topo.round)) is not None

    def maybe_scale_up(self, topo: Topology) -> Optional[float]:
        """End the round for newcomers once they waited a stability window (below max only).

        Returns the seconds until the window closes (to wake up in time), or None.
        """
        s = self.settings
        if (not self.view.mirrors_nodes  # only the leader sees newcomers
                or len(topo.members) >= s.max_nodes or self.view.under(self.keys.dones(topo.round))):
            self._newcomers_since = None
            return None
        if self.view.node_count() <= len(topo.members):  # no newcomer (a lost member ends the round instead)
            self._newcomers_since = None
            return None
        members = {m.node_id for m in topo.members}
        # The window opens when a newcomer registers (so it overlaps the newcomer's own start-up);
        # the round ends once it has closed and at least one newcomer is ready (waiting for a round).
        newcomers = {n: info for n, (info, _) in self.view.nodes().items() if n not in members}
        if not newcomers:
            self._newcomers_since = None
            return None
        now = time.monotonic()
        if self._newcomers_since is None:
            self._newcomers_since = now
            self._say(f"{len(newcomers)} node(s) joining; scaling up in {s.stability_window:.1f}s")
            self.store.create(self.keys.joining(topo.round), json.dumps({"nodes": sorted(newcomers)}))
        ready = sorted(n for n, info in newcomers.items() if info.waiting_for > topo.round)
        if now - self._newcomers_since >= s.stability_window and ready:
            newcomers = {n: newcomers[n] for n in ready}
            reason = f"scale-up: {len(newcomers)} node(s) joined ({', '.join(sorted(newcomers))})"
            self.create_flag(self.keys.end(topo.round), {"reason": reason, "by": self.node_id}, records.end_flag)
            return None
        left = s.stability_window - (now - self._newcomers_since)
        return left if left > 0 else None  # closed: the newcomer's "ready" record will wake us

    def report_failure(self, topo: Topology, failures: List[Dict[str, Any]]) -> None:
        """Record our failed workers and flag the round failed (first flag wins)."""
        self.store.put_json(self.keys.failure(topo.round, self.node_id), failures)
        first = failures[0] if failures else {}
        flag = {"node": self.node_id, "rank": first.get("rank"), "time": time.time()}
        self.create_flag(self.keys.failed(topo.round), flag, records.failed_flag)

    def create_flag(self, key: str, record: Dict[str, Any], check: Callable[[Any], Any]) -> bool:
        """Create a first-wins flag (True when ours is written); a malformed one in its place, which every
        reader treats as absent, is replaced (compare-and-swap on its revision)."""
        value = json.dumps(record)
        if self.store.create(key, value):
            return True
        kv = self.store.get(key)
        if kv is not None and records.read(kv, check) is None:
            return self.store.cas(key, value, kv.mod_revision)
        return False

    def mark_left(self, round_: int) -> None:
        """A graceful leave of round ``round_`` (before the lease is revoked): survivors may re-form in place."""
        self.store.put_json(self.keys.left(round_, self.node_id), {"time": time.time()})

    def report_done(self, topo: Topology) -> None:
        self.store.put_json(self.keys.done(topo.round, self.node_id), {"time": time.time()})

    def mark_succeeded(self, topo: Topology) -> None:
        _, rev = self.view.topology()
        self._end_job(JobState.SUCCEEDED, "all workers exited 0", topo, rev)

    def root_cause(self, round_: int) -> List[Dict[str, Any]]:
        """Failed workers recorded for round ``round_`` (every node's), oldest first (a malformed
        node's rows are reported once and left out)."""
        kvs, _ = self.store.get_prefix(self.keys.failures(round_))
        rows: List[Dict[str, Any]] = []
        for kv in kvs:
            rows.extend(records.read(kv, records.failure_rows) or [])
        return sorted(rows, key=lambda r: r.get("timestamp") or 0)
