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

Deciding is apart from etcd: :mod:`~elasticrun.rendezvous.plan` decides how a round forms and
:mod:`~elasticrun.rendezvous.roundend` how it ends, on snapshots of the view; this module and the
round watch (:mod:`~elasticrun.rendezvous.watch`) gather the snapshots and wait, and
:mod:`~elasticrun.rendezvous.writer` writes what was decided.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from elasticrun.errors import ElasticrunError, RendezvousError, StoreError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.ended import expire, stop_if_last
from elasticrun.rendezvous.inplace import collectives_broke
from elasticrun.rendezvous.leader import Leadership
from elasticrun.rendezvous.plan import (
    EndJob,
    Fence,
    Forming,
    FormRound,
    GiveUp,
    JobOver,
    Joined,
    Marks,
    PassedOver,
    Plan,
    Wait,
    check_formed,
    plan_round,
    waiting_message,
)
from elasticrun.rendezvous.records import NodeInfo, RescaleEvent, Topology, WorkerStatus, event_record
from elasticrun.rendezvous.register import register_node
from elasticrun.rendezvous.reuse import Head, JobClaim
from elasticrun.rendezvous.settings import JobChanged, JobEnded, LeaseLost, RendezvousSettings
from elasticrun.rendezvous.states import JobState, RoundOutcome
from elasticrun.rendezvous.storehost import QUICK_WAIT_S, StoreHost
from elasticrun.rendezvous.view import VERIFY_SETTLE_S, JobView
from elasticrun.rendezvous.watch import RoundWatch
from elasticrun.rendezvous.writer import RoundWriter
from elasticrun.store.client import EtcdStore
from elasticrun.store.lease import KeepAlive, LeaseHealth
from elasticrun.waiting import Reminder

log = logging.getLogger(__name__)

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
# A node that does not lead and heard nothing from its view this long compares the keys it waits on with
# etcd (JobView.verify): a watch that etcd ended without a word must not leave it waiting forever.
VIEW_CHECK_S = 20.0
# A first registration that finds the job changed since ensure_config checks it again, this many times.
REGISTER_CHECKS = 5


class Rendezvous:
    """One node's side of the protocol: joining, forming rounds (:meth:`next_round`), watching the round
    it runs (:class:`~elasticrun.rendezvous.watch.RoundWatch`), reporting, leaving."""

    def __init__(
        self,
        store: EtcdStore,
        settings: RendezvousSettings,
        node: NodeInfo,
        host_store: Callable[[], int],
        on_progress: Optional[Callable[[str], None]] = None,
        view: Optional[JobView] = None,
    ) -> None:
        """``host_store`` hosts a fresh c10d store and returns its port; ``on_progress`` hears what we wait
        for; ``view``: the job view to use (default: one of our own, without the node records until we lead)."""
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
        self.view = view if view is not None else JobView(store, self.keys, nodes=False)  # see leader.py
        self.leadership = Leadership(store, self.keys, self.view, node.node_id)
        self.writer = RoundWriter(store, self.keys)
        self.watch = RoundWatch(self.view, self.keys, settings, self.writer, self.leadership, node.node_id,
                                self._say, leading=self.leading, unreachable=self.recently_unreachable)
        self._store_host = StoreHost(host_store, on_ready=self.view.poke)
        self._last_eval = 0.0
        self._marks = Marks()  # what the leader remembers between two looks at a forming round (plan.py)
        self.outage_over_at: Optional[float] = None  # when etcd answered again after an outage we noticed
        self._job_settings: Dict[str, Any] = {}
        self._head: Optional[Head] = None  # the job's settings and end as ensure_config found them
        self._stop: Tuple[str, Optional[int]] = ("it stopped", None)  # why we leave (see leaving)
        self._ran = False  # a round included this node (else it ends as a spare that ran nothing)
        # Our workers crashed, recoverably in place: the next round may form without us (NodeInfo.sits_out).
        self.sit_out_next = False

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

        Each turn gathers what the view says, decides (:mod:`elasticrun.rendezvous.plan`), carries the
        decision out, and waits. Raises JobEnded when the job is over, LeaseLost when we must fence, and
        RendezvousError when too few nodes remain for too long.
        """
        p = self._start_forming()
        while True:
            self.beat()
            topo, rev = self.view.topology()
            lease_id = self.lease.lease_id if self.lease is not None else None
            over = check_formed(self._lease_problem(), self.view.state(), topo, p.target, self.node_id, lease_id,
                                self._ran)
            if isinstance(over, Joined):
                self._ran = True
                return over.topology
            if over is not None:
                self._not_ours(over, p)
                continue
            self._publish_port(p)
            if not self.leading():  # the leader forms the round (and ends the job if too few join)
                self._follow(p, topo)
                continue
            if topo is not None and self.watch.round_change(topo) is None:
                # A round runs without us (we are a spare or a newcomer): as the leader we still end it
                # when a member is lost, or for newcomers after the stability window.
                self.watch.maybe_scale_up(topo)
            plan = plan_round(self._forming(p, topo), self.settings, time.monotonic())
            self._carry_out(plan, p, topo, rev)

    def _start_forming(self) -> _Progress:
        """Say we are ready for the next round (our record's ``waiting_for``); the call's memory."""
        topo, _ = self.view.topology()
        target = 0 if topo is None else topo.round + 1
        # The store starts on a thread (the first one imports torch): we are ready for the round at
        # once, and publish its port when it is up.
        self._store_host.start()
        port = self._store_host.port(QUICK_WAIT_S)
        was_member = topo is not None and topo.member(self.node_id) is not None
        status = WorkerStatus.RESCALING if was_member else WorkerStatus.JOINING  # newcomers are Joining
        sits_out, self.sit_out_next = (target if self.sit_out_next else -1), False
        self.publish(waiting_for=target, store_port=port, status=status, sits_out=sits_out)
        now = time.monotonic()
        self._marks = Marks(changed_at=now, busy_since=self._marks.busy_since)
        timeout = self.settings.join_timeout if topo is None else self.settings.rescale_timeout
        return _Progress(target, now, timeout, port, self.watch.view_version(), heard_at=now)

    def _lease_problem(self) -> Optional[str]:
        """Why our lease is not valid (None while it is)."""
        if self.lease_valid():
            return None
        return (self.lease.lost_reason if self.lease else None) or "etcd did not confirm it in time"

    def _not_ours(self, over: Union[Fence, JobOver, PassedOver], p: _Progress) -> None:
        """The wait ended without a round for us: fence, the job ended, or a round formed without us."""
        if isinstance(over, Fence):
            raise LeaseLost(over.reason)
        if isinstance(over, JobOver):
            raise JobEnded(dict(over.state), spare=over.spare)
        p.target = over.target  # not chosen (spare): wait for the next round
        self.publish(waiting_for=p.target, status=WorkerStatus.JOINING)
        msg = waiting_message(self.settings, self.node_id, over.topology, p.target, None, passed_over=True)
        p.said = self._tell(p.said, msg, None)

    def _publish_port(self, p: _Progress) -> None:
        if not p.port:
            p.port = self._store_host.port()
            if p.port:
                self.publish(store_port=p.port)

    def _follow(self, p: _Progress, topo: Optional[Topology]) -> None:
        """Another node leads: say what we wait for, and wait for the view (our beat covers the wait)."""
        msg = waiting_message(self.settings, self.node_id, topo, p.target, self.leadership.holder())
        p.said = self._tell(p.said, msg, p.deadline)
        if self.lease is not None:
            self.lease.beat(busy_for=FOLLOWER_WAIT_S)
        version = self.watch.wait_view(p.version, FOLLOWER_WAIT_S)
        now = time.monotonic()
        if version != p.version:
            p.version, p.heard_at = version, now
        elif now - p.heard_at >= VIEW_CHECK_S:
            p.heard_at = now
            self._check_view()

    def _check_view(self) -> None:
        """Compare what a following node waits on (the leader key, the round, the job's end) with etcd; a
        view that missed a change reads the job again (:meth:`JobView.verify`)."""
        if self.lease is not None:  # one read, and a short wait for events in flight
            self.lease.beat(busy_for=VERIFY_SETTLE_S + getattr(self.store, "retry_timeout", FOLLOWER_WAIT_S))
        try:
            self.view.verify([self.keys.leader, self.keys.topology, self.keys.state])
        except StoreError as err:  # etcd does not answer: our lease's health tells the loop
            log.debug("could not check the view against etcd: %s", err)

    def _forming(self, p: _Progress, prev: Optional[Topology]) -> Forming:
        """What :func:`plan_round` decides on, from our view: as the leader it mirrors the whole job in
        revision order on one watch, and the round's transaction compares the previous round's revision,
        so a view behind etcd can only lose the compare, never write a round planned on old records."""
        view, keys = self.view, self.keys
        failed = end = None
        rows: Tuple[Dict[str, Any], ...] = ()
        if prev is not None:
            failed = view.record(keys.failed(prev.round), records.failed_flag)
            end = view.record(keys.end(prev.round), records.end_flag)
            if failed is not None:  # a failed re-form is free; a crash may be recovered in place
                rows = tuple(row for kv in view.under(keys.failures(prev.round)).values()
                             for row in records.read(kv, records.failure_rows) or [])
        restarts = tuple(view.record(keys.restarts, records.restart_history) or ())
        return Forming(target=p.target, me=self.node_id, nodes=view.nodes(), prev=prev, failed=failed, end=end,
                       failure_rows=rows, restarts=restarts, started=p.started, timeout=p.timeout,
                       wall=time.time(), marks=self._marks)

    def _carry_out(self, plan: Plan, p: _Progress, prev: Optional[Topology], prev_rev: int) -> None:
        """Do what :func:`plan_round` decided, then wait for the view to change."""
        if isinstance(plan, GiveUp):
            if plan.end_job and prev is not None:
                self.writer.end_job(JobState.FAILED, plan.reason, prev.round, prev_rev, plan.exit_code)
            self.leaving(f"gave up: {plan.reason}", plan.exit_code)
            raise RendezvousError(f"job {self.settings.job_id!r}: {plan.reason}; start more nodes or lower --nnodes")
        self._marks = plan.marks
        if isinstance(plan, Wait) and plan.soon:
            p.version = self.view.wait_change(p.version, 0.25)
            return
        if isinstance(plan, (Wait, FormRound)) and plan.note:
            self._say(plan.note)
        if isinstance(plan, Wait):
            p.said = self._tell(p.said, plan.reason, p.deadline)
        elif isinstance(plan, EndJob) and prev is not None:
            self.writer.end_job(plan.state, plan.reason, prev.round, prev_rev, plan.exit_code)
            p.said = self._tell(p.said, "job failed", p.deadline)
        elif isinstance(plan, FormRound):
            self.writer.form(plan, prev_rev)
        p.version = self._wait_change(p.version)

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

    # -- a round running ------------------------------------------------------------------

    def view_version(self) -> int:
        """The view's version that :meth:`wait_view` waits on (see :class:`RoundWatch`)."""
        return self.watch.view_version()

    def wait_view(self, since: int, timeout: float) -> int:
        """Wait for a change of the view that matters to us (see :meth:`RoundWatch.wait_view`)."""
        return self.watch.wait_view(since, timeout)

    def round_change(self, topo: Topology) -> Union[str, RoundOutcome, None]:
        """Why round ``topo`` is over (None while it runs; see :meth:`RoundWatch.round_change`)."""
        return self.watch.round_change(topo)

    def scale_up_pending(self, topo: Topology) -> bool:
        """True once the leader saw a newcomer: round ``topo`` ends within a stability window."""
        return self.watch.scale_up_pending(topo)

    def maybe_scale_up(self, topo: Topology) -> Optional[float]:
        """The leader ends the round for newcomers (see :meth:`RoundWatch.maybe_scale_up`)."""
        return self.watch.maybe_scale_up(topo)

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

    def ended_for_newcomers(self, round_: int) -> bool:
        """Whether round ``round_`` ended only for newcomers (its end record names no lost member, it has
        no failure flag and the job goes on): no member's collective broke."""
        end = self.view.record(self.keys.end(round_), records.end_flag)
        return end is not None and end.get("lost") is None and not self.round_failed(round_) and not self.view.state()

    def collectives_broke(self, round_: int) -> bool:
        """Whether round ``round_`` ended in a way that breaks its members' collectives: a worker failure, or
        a member lost (its lease expired) rather than gone by a graceful leave (its ``left`` marker, written
        before its lease went, so the view holds it by the time it holds the end record)."""
        end = self.view.record(self.keys.end(round_), records.end_flag)
        prefix = self.keys.lefts(round_)
        left = [key[len(prefix):] for key in self.view.under(prefix)]
        return collectives_broke(self.round_failed(round_), end.get("lost") if end is not None else None, left)

    def round_failed(self, round_: int) -> bool:
        """Whether round ``round_`` has its failure flag (a malformed one counts as absent)."""
        return self.view.record(self.keys.failed(round_), records.failed_flag) is not None

    def report_failure(self, topo: Topology, failures: List[Dict[str, Any]]) -> None:
        """Record our failed workers and flag the round failed (first flag wins)."""
        self.writer.report_failure(topo.round, self.node_id, failures)

    def report_done(self, topo: Topology) -> None:
        """Our workers of round ``topo`` all exited 0."""
        self.writer.report_done(topo.round, self.node_id)

    def mark_left(self, round_: int) -> None:
        """A graceful leave of round ``round_`` (before the lease is revoked): ``elasticrun status`` shows it Left."""
        self.writer.mark_left(round_, self.node_id)

    def mark_succeeded(self, topo: Topology) -> None:
        """Every member finished: record the job succeeded."""
        _, rev = self.view.topology()
        self.writer.end_job(JobState.SUCCEEDED, "all workers exited 0", topo.round, rev)

    def root_cause(self, round_: int) -> List[Dict[str, Any]]:
        """Failed workers recorded for round ``round_`` (every node's), oldest first (a malformed
        node's rows are reported once and left out)."""
        kvs, _ = self.store.get_prefix(self.keys.failures(round_))
        rows: List[Dict[str, Any]] = []
        for kv in kvs:
            rows.extend(records.read(kv, records.failure_rows) or [])
        return sorted(rows, key=lambda r: r.get("timestamp") or 0)


@dataclass
class _Progress:
    """What one :meth:`Rendezvous.next_round` call remembers from turn to turn."""

    target: int  # the round we wait for
    started: float  # (monotonic) when we began to wait
    timeout: float  # how long too few nodes may wait
    port: int  # our c10d store's port (0 while it starts)
    version: int  # the view's version at our last look
    said: str = ""  # what we said last
    heard_at: float = 0.0  # (monotonic) when the view last changed while we followed (or we began to wait)

    @property
    def deadline(self) -> float:
        return self.started + self.timeout


__all__ = ["JobEnded", "LeaseLost", "Rendezvous", "RendezvousSettings"]
