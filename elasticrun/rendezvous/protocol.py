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
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from elasticrun.config import describe_mismatch
from elasticrun.errors import ConfigError, RendezvousError
from elasticrun.job.keys import JobKeys
from elasticrun.launch.restarts import RestartBudget
from elasticrun.launch.states import JobState, RoundOutcome
from elasticrun.rendezvous.ranks import classify, plan_members
from elasticrun.rendezvous.records import NodeInfo, RescaleEvent, RescaleType, Topology, WorkerStatus
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import EtcdStore
from elasticrun.store.lease import KeepAlive, LeaseHealth

log = logging.getLogger(__name__)

EVENT_HISTORY = 50  # rescale events kept in etcd
FORM_GRACE = 1.0  # how long the others leave writing a ready round to its group rank 0
# While forming a round, look at the view at most every EVAL_PER_NODE s x registered nodes (capped):
# a look costs O(nodes), so this keeps an agent's CPU per second flat as the job grows.
EVAL_PER_NODE = 0.0005
EVAL_INTERVAL_MAX = 0.2


class JobEnded(Exception):
    """The job reached a terminal state (``state`` key): succeeded or failed."""

    def __init__(self, state: Dict[str, Any]) -> None:
        super().__init__(state.get("reason", state.get("state", "")))
        self.state = state

    @property
    def succeeded(self) -> bool:
        return self.state.get("state") == JobState.SUCCEEDED.value


class LeaseLost(Exception):
    """Our lease expired or could not be confirmed: we must fence ourselves and rejoin."""


@dataclass
class RendezvousSettings:
    """What the protocol needs from the launch configuration."""

    job_id: str  # --rdzv-id
    min_nodes: int
    max_nodes: int
    max_restarts: int
    heartbeat_timeout: float
    stability_window: float
    rescale_timeout: float
    join_timeout: float
    # Liveness: a main loop silent this long stops refreshing the lease (None: no gate).
    stall_after: Optional[float] = None
    # How long to wait for the members of the previous round to stop their workers before
    # forming the next round without them (a node that neither stops nor loses its lease).
    busy_timeout: float = 60.0

    @property
    def job(self) -> str:
        """Old name of :attr:`job_id`."""
        return self.job_id

    @property
    def rejoin_grace(self) -> float:
        """After an etcd outage, how long a member may be missing before its round is over."""
        return 2.0 * self.heartbeat_timeout
    restart_window: float = 0.0  # --restart-window: count max_restarts within this many seconds (0: whole job)


class Rendezvous:
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
        # Called at every turn of the owner's loops (see beat): the agent raises a pending signal there.
        self.on_beat: Callable[[], None] = lambda: None
        self.lease: Optional[KeepAlive] = None
        self.view = JobView(store, self.keys)
        self._newcomers_since: Optional[float] = None
        self._last_eval = 0.0
        self._plan: Tuple[int, Tuple[str, ...]] = (-1, ())
        self._plan_at = 0.0
        self._busy_since: Optional[Tuple[int, float]] = None  # (round, since) the previous members were busy
        self.outage_over_at: Optional[float] = None  # when etcd answered again after an outage we noticed

    @property
    def node_id(self) -> str:
        return self.node.node_id

    # -- joining --------------------------------------------------------------------------

    def ensure_config(self, settings: Dict[str, Any]) -> None:
        """Create the job's settings, or check ours against them (ConfigError on mismatch)."""
        self._clear_finished_job()
        payload = json.dumps(settings, sort_keys=True)
        if self.store.create(self.keys.config, payload):
            return
        existing = self.store.get_json(self.keys.config) or {}
        diff = describe_mismatch(existing, settings)
        if diff:
            raise ConfigError(
                f"job {self.settings.job_id!r} runs with different settings ({diff}); start this node with "
                "the same flags as the others, or use another --rdzv-id"
            )

    def _clear_finished_job(self) -> None:
        """A finished job's keys are removed when a new job reuses its id and nobody is left."""
        kv = self.store.get(self.keys.state)
        if kv is None or self.view.nodes():
            return
        ok = self.store.txn_delete_prefix_if(self.keys.prefix, guard=(self.keys.state, kv.mod_revision))
        if ok:
            log.info("removed the keys of the finished job %s", self.settings.job_id)

    def register(self, wait_for_old: bool = False) -> None:
        """Take a lease and publish our node record under it.

        A record with our id held by another lease means another agent uses our id
        (ConfigError) — unless ``wait_for_old``: then it is our own previous incarnation,
        and we wait for its lease to expire.
        """
        key = self.keys.node(self.node_id)
        ttl = self.settings.heartbeat_timeout
        lease = KeepAlive(
            self.store, ttl, on_lost=lambda _reason: self.view.poke(), stall_after=self.settings.stall_after
        )
        record = json.dumps(self.node.replace(heartbeat_at=time.time()).to_dict())
        deadline = time.monotonic() + ttl + 5
        lease.beat(busy_for=ttl + 5)  # the wait below is bounded by that
        while not self.store.create(key, record, lease=lease.lease_id):
            mine = self.store.get(key)
            if mine is None:
                continue  # gone meanwhile (an old record expired): try again
            if mine.lease == lease.lease_id:
                break  # our create went through but its reply was lost; the store's retry then saw the key
            if not wait_for_old:
                lease.revoke()
                raise ConfigError(
                    f"node id {self.node_id!r} is already registered in job {self.settings.job_id!r} by a "
                    "running agent; give every node a unique --node-id"
                )
            try:
                self.store.wait_for(key, lambda kv: kv is None, max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                lease.revoke()
                raise RendezvousError(
                    f"could not re-register node {self.node_id!r}: its old record never expired"
                ) from None
        self._claim_node_rank(lease)
        self.lease = lease

    def _claim_node_rank(self, lease: KeepAlive) -> None:
        """``--node-rank R``: hold ``node-ranks/R`` under our lease; a second node with R is refused."""
        rank = self.node.node_rank
        if rank < 0:
            return
        key = self.keys.node_rank(rank)
        if self.store.create(key, self.node_id, lease=lease.lease_id):
            return
        holder = self.store.get(key)
        if holder is not None and holder.lease == lease.lease_id:
            return
        lease.revoke()
        owner = holder.value.decode(errors="replace") if holder is not None else "another node"
        raise ConfigError(
            f"--node-rank {rank} is already taken in job {self.settings.job_id!r} by node {owner!r}; give every "
            "node its own --node-rank (0 .. nnodes-1)"
        )

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

    def leave(self) -> None:
        """Leave the job at once: revoke the lease so our keys vanish."""
        if self.lease is not None:
            self.lease.revoke()
            self.lease = None
        self.view.close()

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
        port = self._host_store()
        was_member = topo is not None and topo.member(self.node_id) is not None
        status = WorkerStatus.RESCALING if was_member else WorkerStatus.JOINING  # newcomers are Joining
        self.publish(waiting_for=target, store_port=port, status=status)
        started = time.monotonic()
        last_waiting: List[str] = []
        changed_at = time.monotonic()
        said = ""
        version = self.view.version
        while True:
            self.beat()
            if not self.lease_valid():
                raise LeaseLost(self.lease.lost_reason if self.lease else "no lease")
            state = self.view.state()
            if state:
                raise JobEnded(state)
            topo, rev = self.view.topology()
            if topo is not None and topo.round >= target:
                me = topo.member(self.node_id)
                if me is not None and self.lease is not None and me.lease == self.lease.lease_id:
                    return topo
                target = topo.round + 1  # not chosen (spare): wait for the next round
                self.publish(waiting_for=target, status=WorkerStatus.JOINING)
                said = self._tell(said, f"waiting as a spare: round {topo.round} is full")
                continue
            nodes = self.view.nodes()
            waiting = sorted(n for n, (info, _) in nodes.items() if info.waiting_for == target)
            if self.node_id not in waiting:  # the view has not caught up with our own record yet
                version = self.view.wait_change(version, 0.25)
                continue
            if waiting != last_waiting:
                last_waiting, changed_at = waiting, time.monotonic()
            wait_msg = self._try_form(target, topo, rev, nodes, changed_at)
            if wait_msg:
                said = self._tell(said, wait_msg)
                if len(waiting) < self.settings.min_nodes and time.monotonic() - started > timeout:
                    reason = (
                        f"only {len(waiting)} of at least {self.settings.min_nodes} nodes joined within "
                        f"{timeout:.0f}s"
                    )
                    if topo is not None:
                        self._end_job(JobState.FAILED, reason, topo, rev)
                    raise RendezvousError(f"job {self.settings.job_id!r}: {reason}; start more nodes or lower --nnodes")
            version = self._wait_change(version)

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

    def _tell(self, said: str, msg: str) -> str:
        if msg != said:
            self._say(msg)
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
        failed = prev is not None and self.view.get(self.keys.failed(prev.round)) is not None
        members, spares = plan_members(prev, waiting, s.max_nodes)
        kind = classify(prev, members, failed)
        # A worker failure that comes with a lost node is the node's loss (its peers' collectives
        # broke), a membership change: it does not use up a restart.
        counts = failed and kind in (RescaleType.RESTART, RescaleType.SCALE_UP)
        restarts = 0 if prev is None else prev.restart_count + (1 if counts else 0)
        budget = RestartBudget(s.max_restarts, s.restart_window)
        history = (self.store.get_json(self.keys.restarts) or {}).get("times", []) if counts else []
        if counts and prev is not None and not budget.allows(prev.restart_count, history, time.time()):
            self._end_job(JobState.FAILED, f"workers failed and all {budget.describe()} are used up", prev, prev_rev)
            return "job failed"
        # Designated writer: the new group rank 0 writes the round; the others stand back for
        # FORM_GRACE s (so N agents don't all race the same compare-and-swap), then try too in
        # case it died meanwhile. The CAS keeps it correct either way.
        plan = (target, tuple(m.node_id for m in members))
        if self._plan != plan:
            self._plan, self._plan_at = plan, time.monotonic()
        if members[0].node_id != self.node_id and time.monotonic() - self._plan_at < FORM_GRACE:
            return f"round {target} is ready: its group rank 0 ({members[0].node_id}) writes it"
        leader_info = nodes[members[0].node_id][0]
        topo = Topology(
            round=target,
            members=members,
            master_addr=leader_info.addr,
            master_port=leader_info.store_port,
            restart_count=restarts,
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
        end = self.view.get_json(self.keys.end(prev.round))
        if end:
            return str(end.get("reason", "round ended"))
        if kind in (RescaleType.SCALE_DOWN, RescaleType.REPLACE):
            return "node(s) left or lost their lease"
        return "round ended"

    def _trim_history(self, newest: int) -> None:
        old = newest - EVENT_HISTORY
        if old >= 0 and old % 10 == 0:
            for n in range(max(0, old - 10), old + 1):
                self.store.delete(self.keys.event(n))
                self.store.delete_prefix(self.keys.round(n))

    def _end_job(self, state: JobState, reason: str, topo: Topology, topo_rev: int) -> None:
        record = {"state": state.value, "reason": reason, "round": topo.round, "time": time.time()}
        self.store.txn_put_many((self.keys.topology, topo_rev), [(self.keys.state, json.dumps(record), None)])

    # -- while a round runs ------------------------------------------------------------------

    def rescale_event(self, round_: int) -> Optional[RescaleEvent]:
        d = self.view.get_json(self.keys.event(round_))
        try:
            return None if d is None else RescaleEvent.from_dict(d)
        except (ValueError, TypeError, KeyError, AttributeError):  # another agent's bad record: ignore it
            log.warning("ignoring malformed rescale event of round %d", round_)
            return None

    def round_change(self, topo: Topology) -> Optional[str]:
        """Why round ``topo`` is over (None while it runs); RoundOutcome.SUCCEEDED when every member finished."""
        state = self.view.state()
        if state:
            return f"job {state.get('state')}"
        current, _ = self.view.topology()
        if current is None or current.round != topo.round:
            return "a newer round was formed"
        if self.view.get(self.keys.failed(topo.round)) is not None:
            failed = self.view.get_json(self.keys.failed(topo.round)) or {}
            return f"worker failure on {failed.get('node', '?')}"
        end = self.view.get_json(self.keys.end(topo.round))
        if end is not None:
            return str(end.get("reason", "round ended"))
        nodes = self.view.nodes()
        members = current.members  # the same round; a member may have rejoined after an outage (new lease)
        for m in members:
            entry = nodes.get(m.node_id)
            if entry is None or entry[1] != m.lease:
                if self.recently_unreachable():
                    continue  # after an etcd outage every lease may have expired: let members rejoin
                return f"node {m.node_id} left or lost its lease"
        if len(self.view.under(self.keys.dones(topo.round))) >= len(topo.members):
            return RoundOutcome.SUCCEEDED
        return None

    def maybe_scale_up(self, topo: Topology) -> Optional[float]:
        """End the round for newcomers once they waited a stability window (below max only).

        Returns the seconds until the window closes (to wake up in time), or None.
        """
        s = self.settings
        if len(topo.members) >= s.max_nodes or self.view.under(self.keys.dones(topo.round)):
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
        ready = sorted(n for n, info in newcomers.items() if info.waiting_for > topo.round)
        if now - self._newcomers_since >= s.stability_window and ready:
            newcomers = {n: newcomers[n] for n in ready}
            reason = f"scale-up: {len(newcomers)} node(s) joined ({', '.join(sorted(newcomers))})"
            self.store.create(self.keys.end(topo.round), json.dumps({"reason": reason, "by": self.node_id}))
            return None
        left = s.stability_window - (now - self._newcomers_since)
        return left if left > 0 else None  # closed: the newcomer's "ready" record will wake us

    def report_failure(self, topo: Topology, failures: List[Dict[str, Any]]) -> None:
        """Record our failed workers and flag the round failed (first flag wins)."""
        self.store.put_json(self.keys.failure(topo.round, self.node_id), failures)
        first = failures[0] if failures else {}
        flag = {"node": self.node_id, "rank": first.get("rank"), "time": time.time()}
        self.store.create(self.keys.failed(topo.round), json.dumps(flag))

    def report_done(self, topo: Topology) -> None:
        self.store.put_json(self.keys.done(topo.round, self.node_id), {"time": time.time()})

    def mark_succeeded(self, topo: Topology) -> None:
        _, rev = self.view.topology()
        self._end_job(JobState.SUCCEEDED, "all workers exited 0", topo, rev)

    def root_cause(self, round_: int) -> List[Dict[str, Any]]:
        """Failed workers recorded for round ``round_`` (every node's), oldest first."""
        kvs, _ = self.store.get_prefix(self.keys.failures(round_))
        rows: List[Dict[str, Any]] = []
        for kv in kvs:
            rows.extend(kv.json())
        return sorted(rows, key=lambda r: r.get("timestamp") or 0)
