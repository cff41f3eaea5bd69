"""The round protocol: register, agree on a round by compare-and-swap, notice when it ends.

Knows nothing of processes: the launcher tells it when local workers failed or finished,
and gives it a callable that hosts a fresh c10d store for each round it may lead.

A round ends when (all watched, never polled):
- a member's node key disappears or changes incarnation (lease expiry = death, revoke = leave);
- ``rounds/<n>/failed`` appears (a worker crashed somewhere: counts one restart);
- ``rounds/<n>/end`` appears (a member decided to scale up after the stability window);
- every member reported ``done`` (success) — or the job's ``state`` turns terminal.

The next round forms only once every surviving member of the previous one is idle
(its workers are dead), so a new round never meets a stale worker.

One agent, the leader (:mod:`elasticrun.rendezvous.leader`), watches every node record:
it forms the rounds, and ends a round (``rounds/<n>/end``) when a member is lost or newcomers
waited a stability window. The others watch everything but the node records, so the watch
deliveries of a rendezvous grow linearly with the nodes, not quadratically.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from elasticrun.errors import ElasticrunError, RendezvousError, StoreError
from elasticrun.job import records
from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.keys import JobKeys
from elasticrun.job.requests import utc
from elasticrun.rendezvous.ended import expire, stop_if_last
from elasticrun.rendezvous.inplace import plan_inplace, reform_failed
from elasticrun.rendezvous.leader import Leadership
from elasticrun.rendezvous.ranks import classify, plan_members
from elasticrun.rendezvous.records import NodeInfo, RescaleEvent, RescaleType, Topology, WorkerStatus
from elasticrun.rendezvous.register import register_node
from elasticrun.rendezvous.restarts import RestartBudget
from elasticrun.rendezvous.reuse import Head, JobClaim
from elasticrun.rendezvous.running import RoundMonitor
from elasticrun.rendezvous.settings import JobChanged, JobEnded, LeaseLost, RendezvousSettings
from elasticrun.rendezvous.states import JobState
from elasticrun.rendezvous.storehost import QUICK_WAIT_S, StoreHost
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import EtcdStore
from elasticrun.store.lease import KeepAlive, LeaseHealth
from elasticrun.waiting import Reminder

log = logging.getLogger(__name__)

EVENT_HISTORY = 50  # rescale events kept in etcd
# While forming a round, look at the view at most every EVAL_PER_NODE s x registered nodes (capped):
# a look costs O(nodes), so this keeps an agent's CPU per second flat as the job grows.
EVAL_PER_NODE = 0.0005
EVAL_INTERVAL_MAX = 0.2
# A node that does not lead waits this long at most between two looks while a round forms: everything
# it waits for wakes it (the round record, the leader key, the job's state, its lease lost, its store
# up; a signal interrupts the wait), and its liveness beat covers the wait. Timed wake-ups are pure
# cost: N waiting nodes waking once a second each, over a formation that takes longer with N, grew
# the cost of a round with N² (4,096 simulated agents: a third of their CPU).
FOLLOWER_WAIT_S = 5.0
# A first registration that finds the job changed since ensure_config checks it again, this many times.
REGISTER_CHECKS = 5


class Rendezvous(RoundMonitor):
    """One node's side of the protocol."""

    def __init__(
        self,
        store: EtcdStore,
        settings: RendezvousSettings,
        node: NodeInfo,
        host_store: Callable[[], int],
        on_progress: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.keys = JobKeys(settings.job_id)
        self.node = node
        self._host_store = host_store
        self._say = on_progress or (lambda msg: log.info(msg))
        self._reminder = Reminder(self._say, "", every=5.0, max_every=60.0)  # re-says a long wait (_tell)
        # Called at every turn of the owner's loops (see beat): the agent raises a pending signal there.
        self.on_beat: Callable[[], None] = lambda: None
        self.lease: Optional[KeepAlive] = None
        self.view = JobView(store, self.keys, nodes=False)  # the leader mirrors the nodes (see leader.py)
        self.leadership = Leadership(store, self.keys, self.view, node.node_id)
        self._store_host = StoreHost(host_store, on_ready=self.view.poke)
        self._newcomers_since: Optional[float] = None
        self._last_eval = 0.0
        self._busy_since: Optional[Tuple[int, float]] = None  # (round, since) the previous members were busy
        self._members_checked: Optional[Tuple[int, int]] = None  # (round, view.members_version) checked
        self.outage_over_at: Optional[float] = None  # when etcd answered again after an outage we noticed
        self._job_settings: Dict[str, Any] = {}
        self._head: Optional[Head] = None  # the job's settings and end as ensure_config found them
        self._stop: Tuple[str, Optional[int]] = ("it stopped", None)  # why we leave (see leaving)
        self._ran = False  # a round included this node (else it ends as a spare that ran nothing)

    @property
    def node_id(self) -> str:
        return self.node.node_id

    # -- joining --------------------------------------------------------------------------

    def ensure_config(self, settings: Dict[str, Any]) -> None:
        """Create the job's settings, or check ours against them (ConfigError on mismatch).

        An ended job's keys under our id are removed first (see :mod:`elasticrun.rendezvous.reuse`);
        :meth:`register` then holds only while the settings we checked are still the job's.
        """
        self._job_settings = settings
        claim = JobClaim(self.store, self.keys, settings, timeout=self.settings.join_timeout,
                         grace=self.settings.rejoin_grace, say=self._say)
        self._head = claim.run()
        # The view was read before: when etcd changed since (an ended job's keys removed, the settings
        # written), read it again, so that nothing of the old job (its state, its round) is seen as ours.
        view_revs = [None if kv is None else kv.mod_revision
                     for kv in (self.view.get(k) for k in (self.keys.config, self.keys.state, self.keys.topology))]
        head_revs = [None if kv is None else kv.mod_revision
                     for kv in (self._head.config_kv, self._head.state_kv, self._head.topology_kv)]
        if view_revs != head_revs:
            self.view.resync()

    def register(self, wait_for_old: bool = False) -> None:
        """Take a lease and publish our node record under it (see :func:`register_node`).

        The record is written only while the job's ``config`` and ``state`` are as :meth:`ensure_config`
        found them; when they changed (the job ended or was replaced meanwhile), the first registration
        checks the job again and retries; a later one (``wait_for_old``: after losing our lease) stops
        with a retryable RendezvousError, since the job it belonged to is gone.
        """
        for _ in range(REGISTER_CHECKS):
            guards = [] if self._head is None else self._head.guards(self.keys)
            try:
                self.lease = register_node(
                    self.store, self.keys, self.settings, self.node, on_lost=lambda _reason: self.view.poke(),
                    wait_for_old=wait_for_old, guards=guards,
                )
                return
            except JobChanged:
                if wait_for_old:
                    raise RendezvousError(
                        f"job {self.settings.job_id!r} ended or was replaced while this node re-registered; "
                        "start it again to join the job now under this id"
                    ) from None
                self.ensure_config(self._job_settings)
        raise RendezvousError(f"job {self.settings.job_id!r} kept changing while this node registered; try again")

    def reregister(self) -> None:
        """After losing the lease: join again as a new incarnation."""
        old = self.lease
        self.lease = None
        if old is not None:
            old.revoke()
        self.node = self.node.replace(registered_at=time.time(), waiting_for=-1, status=WorkerStatus.JOINING)
        self.register(wait_for_old=True)

    def publish(self, **changes: Any) -> None:
        """Update our node record (under our lease)."""
        assert self.lease is not None
        self.node = self.node.replace(heartbeat_at=time.time(), **changes)
        self.store.put_json(self.keys.node(self.node_id), self.node.to_dict(), lease=self.lease.lease_id)

    def leaving(self, reason: str, exit_code: Optional[int] = None) -> None:
        """Why this node leaves (told before :meth:`leave`): recorded as the job's end if it is the last."""
        self._stop = (reason, exit_code)

    def leave(self, revoke: bool = True) -> None:
        """Leave the job at once: revoke the lease so our keys vanish (``revoke=False``, etcd failing:
        only stop refreshing it; it expires on its own and the exit waits on no etcd call).

        After a revoke, the last node of a job without an outcome records it ``stopped``, and a node of
        an ended job puts its keys on the expiry lease (:mod:`elasticrun.rendezvous.ended`).
        """
        if self.lease is not None:
            if revoke:
                self.lease.revoke()
                self._after_leaving()
            else:
                self.lease.stop()
            self.lease = None
        self.view.close()

    def _after_leaving(self) -> None:
        if not self.settings.record_end:
            return
        reason, code = self._stop
        try:
            guards = [] if self._head is None else self._head.guards(self.keys)[:1]  # the config we joined under
            if stop_if_last(self.store, self.keys, f"its last node, {self.node_id}, left ({reason})", code, guards):
                log.info("job %s stopped: %s was its last node", self.settings.job_id, self.node_id)
            if self.settings.ended_ttl > 0:
                expire(self.store, self.keys, self.node_id, self.settings.ended_ttl)
        except ElasticrunError as err:  # best effort: etcd is going away, or we may no longer write
            log.warning("could not record the end of job %s in etcd: %s", self.settings.job_id, err)

    def leading(self) -> bool:
        """Claim the leader key if nobody holds it; True while we lead (our view has every node)."""
        return self.leadership.claim(self.lease.lease_id if self.lease is not None else None)

    def lease_valid(self) -> bool:
        return self.lease is not None and self.lease.valid()

    def lease_health(self) -> LeaseHealth:
        """HELD, IN_DOUBT (etcd unreachable) or LOST; LOST without a lease."""
        return LeaseHealth.LOST if self.lease is None else self.lease.health()

    def beat(self, busy_for: float = 0.0) -> None:
        """The agent's main loop made progress (liveness: keeps the lease refreshed)."""
        self.on_beat()
        if self.lease is not None:
            self.lease.beat(busy_for)

    def recently_unreachable(self) -> bool:
        """True within ``rejoin_grace`` after etcd last failed to answer us (or an outage ended)."""
        marks = [self.outage_over_at]
        if self.lease is not None:
            marks.append(self.lease.last_unreachable)
        last = max((m for m in marks if m is not None), default=None)
        return last is not None and time.monotonic() - last < self.settings.rejoin_grace

    # -- forming a round ------------------------------------------------------------------

    def next_round(self) -> Topology:
        """Block until a round that includes this node forms; return it.

        Raises JobEnded when the job is over, LeaseLost when we must fence, and
        RendezvousError when too few nodes remain for too long.
        """
        topo, _ = self.view.topology()
        target = 0 if topo is None else topo.round + 1
        first = topo is None
        timeout = self.settings.join_timeout if first else self.settings.rescale_timeout
        # The store starts on a thread (the first one imports torch): we are ready for the round
        # at once, and publish its port when it is up.
        self._store_host.start()
        port = self._store_host.port(QUICK_WAIT_S)
        was_member = topo is not None and topo.member(self.node_id) is not None
        status = WorkerStatus.RESCALING if was_member else WorkerStatus.JOINING  # newcomers are Joining
        self.publish(waiting_for=target, store_port=port, status=status)
        started = time.monotonic()
        last_waiting: List[str] = []
        changed_at = time.monotonic()
        said = ""
        deadline = started + timeout  # when the leader gives up on too few nodes
        version = self.view_version()
        while True:
            self.beat()
            if not self.lease_valid():
                raise LeaseLost((self.lease.lost_reason if self.lease else None) or "etcd did not confirm it in time")
            if not port:
                port = self._store_host.port()
                if port:
                    self.publish(store_port=port)
            state = self.view.state()
            if state:
                raise JobEnded(state, spare=not self._ran)
            topo, rev = self.view.topology()
            if topo is not None and topo.round >= target:
                me = topo.member(self.node_id)
                if me is not None and self.lease is not None and me.lease == self.lease.lease_id:
                    self._ran = True
                    return topo
                target = topo.round + 1  # not chosen (spare): wait for the next round
                self.publish(waiting_for=target, status=WorkerStatus.JOINING)
                said = self._tell(said, self._waiting(topo, target, passed_over=True), None)
                continue
            if not self.leading():  # the leader forms the round (and ends the job if too few join)
                said = self._tell(said, self._waiting(topo, target), deadline)
                if self.lease is not None:  # this turn's beat (above) now covers the wait
                    self.lease.beat(busy_for=FOLLOWER_WAIT_S)
                version = self.wait_view(version, FOLLOWER_WAIT_S)
                continue
            if topo is not None and topo.round < target and self.round_change(topo) is None:
                # A round runs without us (we are a spare or a newcomer): as the leader we still end
                # it when a member is lost, or for newcomers after the stability window.
                self.maybe_scale_up(topo)
            nodes = self.view.nodes()
            waiting = sorted(n for n, (info, _) in nodes.items() if info.waiting_for == target)
            if self.node_id not in waiting:  # the view has not caught up with our own record yet
                version = self.view.wait_change(version, 0.25)
                continue
            if waiting != last_waiting:
                last_waiting, changed_at = waiting, time.monotonic()
            wait_msg = self._try_form(target, topo, rev, nodes, changed_at)
            if wait_msg:
                said = self._tell(said, wait_msg, deadline)
                if len(waiting) < self.settings.min_nodes and time.monotonic() - started > timeout:
                    reason = (
                        f"only {len(waiting)} of at least {self.settings.min_nodes} nodes joined within "
                        f"{timeout:.0f}s"
                    ) if topo is None else self._lost_reason(topo, waiting, timeout)
                    if topo is not None:
                        self._end_job(JobState.FAILED, reason, topo, rev, ExitCode.TRANSIENT)
                    self.leaving(f"gave up: {reason}", ExitCode.TRANSIENT)
                    raise RendezvousError(f"job {self.settings.job_id!r}: {reason}; start more nodes or lower --nnodes")
            version = self._wait_change(version)

    def _waiting(self, topo: Optional[Topology], target: int, passed_over: bool = False) -> str:
        """What this node says while it waits for round ``target`` (``passed_over``: round ``topo`` just
        formed without it)."""
        s = self.settings
        if topo is not None and len(topo.members) >= s.max_nodes and topo.member(self.node_id) is None:
            return (f"job {s.job_id!r} is full: round {topo.round} runs with its maximum of {s.max_nodes} node(s) "
                    f"(--nnodes {s.min_nodes}:{s.max_nodes}); this node waits as a spare, runs no worker until a "
                    "node leaves or fails, and exits with the job's outcome")
        if topo is not None and passed_over:
            return f"round {topo.round} formed without this node; waiting for round {target}"
        return f"waiting for round {target}, formed by {self.leadership.holder() or '?'}"

    def _lost_reason(self, prev: Topology, waiting: List[str], timeout: float) -> str:
        """Why a running job fails for want of nodes: which member(s) of ``prev`` were lost, and when."""
        end = self.view.record(self.keys.end(prev.round), records.end_flag) or {}
        lost = [m.node_id for m in prev.members if m.node_id not in waiting]
        if not lost:
            return f"only {len(waiting)} of at least {self.settings.min_nodes} nodes joined within {timeout:.0f}s"
        at = end.get("time") if end.get("lost") in lost else None
        if at is None:  # the round ended first through a worker failure (a collective with the lost node)
            at = (self.view.record(self.keys.failed(prev.round), records.failed_flag) or {}).get("time")
        when = f" at {utc(float(at))}" if isinstance(at, (int, float)) else ""
        who = f"node {lost[0]}" if len(lost) == 1 else f"nodes {', '.join(lost)}"
        return (
            f"{who} of round {prev.round} left or lost its lease{when}, and no node replaced it within "
            f"{timeout:.0f}s (--rescale-timeout): {len(waiting)} node(s) left, at least {self.settings.min_nodes} "
            "needed"
        )

    def _wait_change(self, version: int) -> int:
        """Wait for the view to change, then batch events: look at most every 0.5 ms x nodes.

        With hundreds of nodes joining at once, events arrive far faster than they need to be
        looked at; each look is O(nodes), so without batching a round costs O(nodes²) per agent
        (8 nodes: a look every 4 ms; 256 nodes: every 128 ms). A lone event after a quiet spell
        is looked at at once.
        """
        version = self.view.wait_change(version, 0.25)
        interval = min(EVAL_INTERVAL_MAX, EVAL_PER_NODE * self.view.node_count())
        pause = interval - (time.monotonic() - self._last_eval)
        if pause > 0:
            time.sleep(pause)
        self._last_eval = time.monotonic()
        return self.view.version

    def _tell(self, said: str, msg: str, deadline: Optional[float]) -> str:
        """Say ``msg`` when it differs from ``said``; while it stays the same, say it again now and
        then with the time left until ``deadline`` (none: the time waited)."""
        if msg != said:
            self._say(msg)
            self._reminder.restart(msg, deadline)
        else:
            self._reminder.tick()
        return msg

    def _try_form(
        self,
        target: int,
        prev: Optional[Topology],
        prev_rev: int,
        nodes: Dict[str, Any],
        changed_at: float,
    ) -> Optional[str]:
        """Write round ``target`` if its conditions hold; else return what we are waiting for."""
        s = self.settings
        waiting = [(info, lease) for info, lease in nodes.values() if info.waiting_for == target]
        if prev is not None:
            busy = [
                m.node_id
                for m in prev.members
                if m.node_id in nodes and nodes[m.node_id][1] == m.lease and nodes[m.node_id][0].waiting_for != target
            ]
            if busy:
                if self._busy_since is None or self._busy_since[0] != prev.round:
                    self._busy_since = (prev.round, time.monotonic())
                waited = time.monotonic() - self._busy_since[1]
                if waited < s.busy_timeout:
                    return f"waiting for {len(busy)} node(s) of round {prev.round} to stop their workers"
                # A deadline on every wait: a node that neither stops its workers nor loses its lease
                # is left out (its stale workers cannot commit: the commit fence checks the round).
                self._say(
                    f"node(s) {', '.join(busy)} did not stop their workers within {s.busy_timeout:.0f}s: "
                    "forming the next round without them"
                )
        if len(waiting) < s.min_nodes:
            return f"waiting for nodes: {len(waiting)}/{s.min_nodes} (min) joined"
        settle = s.stability_window - (time.monotonic() - changed_at)
        if prev is None and len(waiting) < s.max_nodes and settle > 0:
            return f"{len(waiting)} node(s) joined; waiting {s.stability_window:.1f}s for more (max {s.max_nodes})"
        failed = prev is not None and self.round_failed(prev.round)
        members, spares = plan_members(prev, waiting, s.max_nodes)
        kind = classify(prev, members, failed)
        # A worker failure that comes with a lost node is the node's loss (its peers' collectives
        # broke), a membership change: it does not use up a restart.
        # A failed in-place re-form (a planned change) falls back to a restart that is not charged.
        counts = failed and kind in (RescaleType.RESTART, RescaleType.SCALE_UP) and not reform_failed(
            prev, self.store, self.keys)
        restarts = 0 if prev is None else prev.restart_count + (1 if counts else 0)
        budget = RestartBudget(s.max_restarts, s.restart_window)
        history = (records.read(self.store.get(self.keys.restarts), records.restart_history) or []) if counts else []
        if counts and prev is not None and not budget.allows(prev.restart_count, history, time.time()):
            self._end_job(JobState.FAILED, f"workers failed and all {budget.describe()} are used up", prev, prev_rev)
            return "job failed"
        # Only the leader writes the round (the compare-and-swap keeps it correct anyway).
        leader_info = nodes[members[0].node_id][0]
        if leader_info.store_port == 0:
            return f"round {target} is ready: waiting for {members[0].node_id} to start its c10d store"
        topo = Topology(
            round=target,
            members=members,
            master_addr=leader_info.addr,
            master_port=leader_info.store_port,
            restart_count=restarts,
            inplace=plan_inplace(prev, members, kind, failed, nodes, self.store, self.keys),
        )
        if failed and kind in (RescaleType.SCALE_DOWN, RescaleType.SCALE_UP, RescaleType.REPLACE):
            reason = f"worker failure in round {prev.round if prev else '?'} and membership change"
        elif failed:
            reason = f"worker failure in round {prev.round if prev else '?'}"
        else:
            reason = self._reason(prev, kind)
        event = RescaleEvent(
            type=kind,
            round=target,
            old_members=prev.node_ids if prev else [],
            new_members=topo.node_ids,
            old_world_size=prev.world_size if prev else 0,
            new_world_size=topo.world_size,
            reason=reason,
            restart_count=restarts,
        )
        puts = [
            (self.keys.topology, json.dumps(topo.to_dict()), None),
            (self.keys.event(target), json.dumps(event.to_dict()), None),
        ]
        if counts:
            puts.append((self.keys.restarts, json.dumps({"times": budget.record(history, time.time())}), None))
        if self.store.txn_put_many((self.keys.topology, prev_rev), puts):
            log.info("formed round %d: %s", target, topo.node_ids)
            self._trim_history(target)
        return None

    def _reason(self, prev: Optional[Topology], kind: RescaleType) -> str:
        if prev is None:
            return "job start"
        end = self.view.record(self.keys.end(prev.round), records.end_flag)
        if end:
            return str(end.get("reason", "round ended"))
        if kind in (RescaleType.SCALE_DOWN, RescaleType.REPLACE):
            return "node(s) left or lost their lease"
        return "round ended"

    def _trim_history(self, newest: int) -> None:
        """Keep the newest EVENT_HISTORY rounds' events and round keys: everything older goes, in two
        range deletes after every round (nothing to delete costs etcd no write). A trim that failed or
        never ran (its agent died) is made up by the next one: the kept history has no gaps, and no
        old round stays behind."""
        first_kept = newest - EVENT_HISTORY + 1
        if first_kept <= 0:
            return
        try:
            self.store.delete_range(self.keys.events, self.keys.event(first_kept))
            self.store.delete_range(self.keys.rounds, self.keys.round(first_kept))
        except StoreError as err:  # the next round trims again
            log.warning("could not trim the job's round history: %s", err)

    def _end_job(self, state: JobState, reason: str, topo: Topology, topo_rev: int,
                 exit_code: Optional[int] = None) -> None:
        """Record the job's end; ``exit_code``: what every agent exits with (None: 0 or 1 by ``state``)."""
        record = {"state": state.value, "reason": reason, "round": topo.round, "time": time.time()}
        if exit_code is not None:
            record["exit_code"] = int(exit_code)
        self.store.txn_put_many((self.keys.topology, topo_rev), [(self.keys.state, json.dumps(record), None)])


__all__ = ["JobEnded", "LeaseLost", "Rendezvous", "RendezvousSettings"]
