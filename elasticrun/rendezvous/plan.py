"""Forming the next round, decided: what a node waiting for round n does next. Pure: no I/O, no clock.

At each turn of :meth:`~elasticrun.rendezvous.protocol.Rendezvous.next_round` the node looks at the
job through its view (see docs/design.md, "A round's life cycle"):

- :func:`check_formed`: is the wait over? Our lease is lost (:class:`Fence`), the job ended
  (:class:`JobOver`), round n formed with us (:class:`Joined`) or without us (:class:`PassedOver`);
- the leader then plans the round from a :class:`Forming` snapshot (:func:`plan_round`): wait
  (:class:`Wait`: members of round n-1 still stop their workers, too few nodes, the stability
  window, the new group rank 0's c10d store not up yet), write the round (:class:`FormRound`),
  fail the job when a worker failure finds the restart budget used up (:class:`EndJob`), or give
  up when too few nodes stayed for too long (:class:`GiveUp`).

The caller gathers the snapshot (from the leader's view, which mirrors every key of the job in
revision order on one watch), passes its clocks (``now``: monotonic; ``Forming.wall``: the wall
clock that records carry), and carries the action out; what it remembers between two looks
(:class:`Marks`) comes in with the snapshot and goes out with the action.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.requests import utc
from elasticrun.rendezvous.inplace import inplace_failed, plan_inplace
from elasticrun.rendezvous.ranks import Candidate, classify, plan_members
from elasticrun.rendezvous.records import NodeInfo, RescaleEvent, RescaleType, Topology
from elasticrun.rendezvous.restarts import RestartBudget
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.states import JobState

Record = Mapping[str, Any]


# -- is the wait over? ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fence:
    """Our lease is lost or unconfirmed: stop and rejoin (LeaseLost)."""

    reason: str


@dataclass(frozen=True)
class JobOver:
    """The job has a terminal state; ``spare``: no round included this node."""

    state: Mapping[str, Any]
    spare: bool


@dataclass(frozen=True)
class Joined:
    """The round formed with this node (under its current lease)."""

    topology: Topology


@dataclass(frozen=True)
class PassedOver:
    """The round formed without this node (a spare): wait for the next one."""

    topology: Topology

    @property
    def target(self) -> int:
        return self.topology.round + 1


def check_formed(
    lease_lost: Optional[str], state: Optional[Mapping[str, Any]], topo: Optional[Topology], target: int,
    node_id: str, lease_id: Optional[int], ran: bool,
) -> Union[Fence, JobOver, Joined, PassedOver, None]:
    """Whether the wait for round ``target`` is over (None: not yet). ``lease_lost``: why our lease is no
    longer valid (None while it is); ``ran``: a round included this node before."""
    if lease_lost is not None:
        return Fence(lease_lost)
    if state:
        return JobOver(state, spare=not ran)
    if topo is None or topo.round < target:
        return None
    me = topo.member(node_id)
    if me is not None and lease_id is not None and me.lease == lease_id:
        return Joined(topo)
    return PassedOver(topo)


def waiting_message(s: RendezvousSettings, node_id: str, topo: Optional[Topology], target: int,
                    leader: Optional[str], passed_over: bool = False) -> str:
    """What a node says while it waits for round ``target`` (``passed_over``: round ``topo`` just formed
    without it; ``leader``: who forms the round, as far as we know)."""
    if topo is not None and len(topo.members) >= s.max_nodes and topo.member(node_id) is None:
        return (f"job {s.job_id!r} is full: round {topo.round} runs with its maximum of {s.max_nodes} node(s) "
                f"(--nnodes {s.min_nodes}:{s.max_nodes}); this node waits as a spare, runs no worker until a "
                "node leaves or fails, and exits with the job's outcome")
    if topo is not None and passed_over:
        return f"round {topo.round} formed without this node; waiting for round {target}"
    return f"waiting for round {target}, formed by {leader or '?'}"


# -- the leader plans the round -------------------------------------------------------------------


@dataclass(frozen=True)
class Marks:
    """What the leader remembers between two looks at a forming round."""

    waiting: Tuple[str, ...] = ()  # the nodes that waited at the last look
    changed_at: float = 0.0  # when that set last changed: the stability window counts from there
    busy_since: Optional[Tuple[int, float]] = None  # (round, since): its members were first seen busy


@dataclass(frozen=True)
class Forming:
    """Everything :func:`plan_round` needs, as the leader's view has it."""

    target: int  # the round to form
    me: str  # this node's id
    nodes: Mapping[str, Tuple[NodeInfo, int]]  # registered nodes: id -> (record, lease)
    prev: Optional[Topology] = None  # the round before (None: the job's first)
    failed: Optional[Record] = None  # round prev's failure flag
    end: Optional[Record] = None  # round prev's end record (a membership change)
    failure_rows: Tuple[Record, ...] = ()  # round prev's failed workers (read when it failed)
    restarts: Tuple[float, ...] = ()  # the restart history (wall times)
    started: float = 0.0  # (monotonic) when this node began to wait for the round
    timeout: float = 0.0  # how long too few nodes may wait: --join-timeout, or --rescale-timeout after a round
    wall: float = 0.0  # the wall clock when the snapshot was taken
    marks: Marks = field(default_factory=Marks)


@dataclass(frozen=True)
class Wait:
    """Not yet: say ``reason`` and look again when the view changes (``soon``: within a moment; our own
    record has not reached the view yet). ``note``: said first, once per look."""

    reason: str
    marks: Marks
    note: str = ""
    soon: bool = False


@dataclass(frozen=True)
class FormRound:
    """Write round ``topology`` and its ``event`` (compare-and-swap on the previous round's revision);
    ``restarts``: the restart history to store with it (None: the round uses no restart)."""

    topology: Topology
    event: RescaleEvent
    restarts: Optional[Tuple[float, ...]]
    marks: Marks
    note: str = ""


@dataclass(frozen=True)
class EndJob:
    """Record the job's end (compare-and-swap on the previous round's revision)."""

    state: JobState
    reason: str
    marks: Marks
    exit_code: Optional[int] = None


@dataclass(frozen=True)
class GiveUp:
    """Too few nodes for too long: leave with ``reason`` (retryable); ``end_job``: a round ran, so the
    job is recorded failed (a job that never formed a round leaves no end)."""

    reason: str
    end_job: bool
    exit_code: int = ExitCode.TRANSIENT


Plan = Union[Wait, FormRound, EndJob, GiveUp]


def plan_round(snap: Forming, s: RendezvousSettings, now: float) -> Plan:
    """What the leader does at this look at round ``snap.target`` (``now``: the monotonic clock)."""
    waiting = sorted(n for n, (info, _) in snap.nodes.items() if info.waiting_for == snap.target)
    if snap.me not in waiting:  # the view has not caught up with our own record yet
        return Wait("", snap.marks, soon=True)
    marks = snap.marks
    if tuple(waiting) != marks.waiting:
        marks = replace(marks, waiting=tuple(waiting), changed_at=now)
    plan = _plan(snap, s, now, marks, [snap.nodes[n] for n in waiting])
    if isinstance(plan, Wait) and len(waiting) < s.min_nodes and now - snap.started > snap.timeout:
        if snap.prev is None:
            reason = f"only {len(waiting)} of at least {s.min_nodes} nodes joined within {snap.timeout:.0f}s"
        else:
            reason = lost_reason(snap, s, waiting)
        return GiveUp(reason, end_job=snap.prev is not None)
    return plan


def _plan(snap: Forming, s: RendezvousSettings, now: float, marks: Marks, waiting: List[Candidate]) -> Plan:
    """:func:`plan_round` once our own record is in the view (``waiting``: the candidates)."""
    prev = snap.prev
    note = ""
    busy = busy_members(prev, snap.nodes, snap.target)
    if busy:
        assert prev is not None
        if marks.busy_since is None or marks.busy_since[0] != prev.round:
            marks = replace(marks, busy_since=(prev.round, now))
        if now - marks.busy_since[1] < s.busy_timeout:  # type: ignore[index]
            return Wait(f"waiting for {len(busy)} node(s) of round {prev.round} to stop their workers", marks)
        # A deadline on every wait: a node that neither stops its workers nor loses its lease is left
        # out (its stale workers cannot commit: the commit fence checks the round).
        note = (f"node(s) {', '.join(busy)} did not stop their workers within {s.busy_timeout:.0f}s: "
                "forming the next round without them")
    if len(waiting) < s.min_nodes:
        return Wait(f"waiting for nodes: {len(waiting)}/{s.min_nodes} (min) joined", marks, note)
    settle = s.stability_window - (now - marks.changed_at)
    if prev is None and len(waiting) < s.max_nodes and settle > 0:
        return Wait(f"{len(waiting)} node(s) joined; waiting {s.stability_window:.1f}s for more (max {s.max_nodes})",
                    marks, note)
    return _round(snap, s, marks, waiting, note)


def busy_members(prev: Optional[Topology], nodes: Mapping[str, Tuple[NodeInfo, int]], target: int) -> List[str]:
    """Members of round ``prev`` still registered under their lease that do not wait for round ``target``
    yet (their workers still run or stop)."""
    if prev is None:
        return []
    return [m.node_id for m in prev.members
            if m.node_id in nodes and nodes[m.node_id][1] == m.lease and nodes[m.node_id][0].waiting_for != target]


def _round(snap: Forming, s: RendezvousSettings, marks: Marks, waiting: List[Candidate], note: str) -> Plan:
    """The round of the nodes ``waiting``: its members, whether it uses a restart, its record and event.

    Nodes whose workers crashed may sit the round out (``NodeInfo.sits_out``): when the others are enough
    (``--nnodes`` min) and re-form in place, the round forms without them at once and they join the next
    one; otherwise they are members as any node (their workers restart as newcomers while the others
    wait). Group rank 0 sits out only without a fixed ``--node-rank`` (it rejoins after the survivors,
    the new rank 0 sending the newcomers the state; a fixed rank 0 would take the place back).
    """
    if snap.prev is not None and snap.failed is not None:
        staying = [c for c in waiting if c[0].sits_out != snap.target]
        if len(staying) < len(waiting) and len(staying) >= s.min_nodes and _rank0_may_go(snap.prev, waiting, staying):
            plan = _form(snap, s, marks, staying, note, sat_out=True)
            if not isinstance(plan, FormRound) or plan.topology.inplace:
                return plan
    return _form(snap, s, marks, waiting, note)


def _form(snap: Forming, s: RendezvousSettings, marks: Marks, waiting: List[Candidate], note: str,
          sat_out: bool = False) -> Plan:
    """:func:`_round` for the candidates ``waiting`` (``sat_out``: crashed nodes sit this round out)."""
    prev = snap.prev
    failed = prev is not None and snap.failed is not None
    members, _spares = plan_members(prev, waiting, s.max_nodes)
    kind = classify(prev, members, failed)
    # A worker failure that comes with a lost node is the node's loss (its peers' collectives broke),
    # a membership change: it does not use up a restart. A crash whose node sits the round out does.
    # A failed in-place re-form (a planned change) falls back to a restart that is not charged.
    charged = (failed and (sat_out or kind in (RescaleType.RESTART, RescaleType.SCALE_UP))
               and not inplace_failed(prev, snap.failure_rows))
    budget = RestartBudget(s.max_restarts, s.restart_window)
    if charged and prev is not None and not budget.allows(prev.restart_count, snap.restarts, snap.wall):
        return EndJob(JobState.FAILED, f"workers failed and all {budget.describe()} are used up", marks)
    rank0 = snap.nodes[members[0].node_id][0]
    if rank0.store_port == 0:
        return Wait(f"round {snap.target} is ready: waiting for {members[0].node_id} to start its c10d store",
                    marks, note)
    restarts = (0 if prev is None else prev.restart_count) + (1 if charged else 0)
    topo = Topology(round=snap.target, members=members, master_addr=rank0.addr, master_port=rank0.store_port,
                    restart_count=restarts, created_at=snap.wall,
                    inplace=plan_inplace(prev, members, kind, failed, snap.nodes, snap.failure_rows))
    event = RescaleEvent(
        type=kind, round=snap.target, old_members=prev.node_ids if prev else [], new_members=topo.node_ids,
        old_world_size=prev.world_size if prev else 0, new_world_size=topo.world_size,
        reason=_sat_out_reason(prev, topo) if sat_out else change_reason(prev, kind, failed, snap.end),
        restart_count=restarts, time=snap.wall, recovers=charged, kept=list(topo.inplace),
    )
    history = tuple(budget.record(snap.restarts, snap.wall)) if charged else None
    return FormRound(topo, event, history, marks, note)


def _rank0_may_go(prev: Topology, waiting: List[Candidate], staying: List[Candidate]) -> bool:
    """Group rank 0 of ``prev`` stays, or it may sit out: it has no fixed ``--node-rank``."""
    rank0 = prev.members[0].node_id
    return any(c[0].node_id == rank0 for c in staying) or all(c[0].node_rank < 0 for c in waiting
                                                              if c[0].node_id == rank0)


def _sat_out_reason(prev: Optional[Topology], topo: Topology) -> str:
    """Why a round formed without the crashed nodes sitting it out."""
    assert prev is not None
    out = ", ".join(n for n in prev.node_ids if topo.member(n) is None)
    return f"worker failure in round {prev.round}: the others re-form at once, {out} rejoins once restarted"


def change_reason(prev: Optional[Topology], kind: RescaleType, failed: bool, end: Optional[Record]) -> str:
    """Why round ``prev`` gave way to a round of ``kind`` (the rescale event's reason)."""
    if prev is None:
        return "job start"
    if failed and kind in (RescaleType.SCALE_DOWN, RescaleType.SCALE_UP, RescaleType.REPLACE):
        return f"worker failure in round {prev.round} and membership change"
    if failed:
        return f"worker failure in round {prev.round}"
    if end:
        return str(end.get("reason", "round ended"))
    if kind in (RescaleType.SCALE_DOWN, RescaleType.REPLACE):
        return "node(s) left or lost their lease"
    return "round ended"


def lost_reason(snap: Forming, s: RendezvousSettings, waiting: Sequence[str]) -> str:
    """Why a running job fails for want of nodes: which member(s) of the previous round were lost, and when."""
    prev = snap.prev
    assert prev is not None
    lost = [m.node_id for m in prev.members if m.node_id not in waiting]
    if not lost:
        return f"only {len(waiting)} of at least {s.min_nodes} nodes joined within {snap.timeout:.0f}s"
    end = snap.end or {}
    at = end.get("time") if end.get("lost") in lost else None
    if at is None:  # the round ended first through a worker failure (a collective with the lost node)
        at = (snap.failed or {}).get("time")
    when = f" at {utc(float(at))}" if isinstance(at, (int, float)) else ""
    who = f"node {lost[0]}" if len(lost) == 1 else f"nodes {', '.join(lost)}"
    return (
        f"{who} of round {prev.round} left or lost its lease{when}, and no node replaced it within "
        f"{snap.timeout:.0f}s (--rescale-timeout): {len(waiting)} node(s) left, at least {s.min_nodes} "
        "needed"
    )


__all__ = ["EndJob", "Fence", "FormRound", "Forming", "GiveUp", "JobOver", "Joined", "Marks", "PassedOver", "Plan",
           "Wait", "busy_members", "change_reason", "check_formed", "lost_reason", "plan_round", "waiting_message"]
