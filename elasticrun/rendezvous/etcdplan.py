"""Which nodes run the members of a job's own etcd: the records agents share, and the decision.

A job that hosts its etcd (torchrun's c10d and static lines) starts with one member, on the node
that hosts it. Its agents grow it to three members on three nodes once three nodes joined, replace a
member whose node is gone, and shrink it to one when fewer than three nodes remain: a cluster of two
members dies with either of them, one member only with its own node. So a job of three or more nodes
survives the loss of any one node; a job of two survives the loss of the node without the member.

Records under ``etcd/`` in the job's prefix (:class:`~elasticrun.job.keys.JobKeys`):

- ``etcd/members/<node>``: :class:`MemberRecord`, the member that node runs (written by that node
  before it asks etcd to add it, so that no member etcd lists is ever nobody's);
- ``etcd/assign/<node>``: :class:`Assignment`, the leader asks that node to start a member (the node
  removes it once its member votes, or marks it ``failed``);
- ``etcd/endpoints``: the client endpoints of the members that vote, for every agent and worker.

:func:`plan` is the decision of the agent that leads the rendezvous: from a :class:`Snapshot` of
etcd's member list, those records and the live nodes, one :class:`Action`. It is pure: the caller
reads, decides, acts, and reads again (launch/etcdmembers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from elasticrun.job import records
from elasticrun.job.records import is_int, is_number, is_text
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.store.types import Member

MOST_MEMBERS = 3  # the size the job's etcd grows to (survives the loss of one member)
ASSIGN_TIMEOUT_S = 60.0  # an assigned node that has no voting member by then is asked no more
ORPHAN_GRACE_S = 10.0  # a member no record names is removed after this long (a record may be on its way)
SETTLE_S = 1.0  # a voting member is removed only once the clients were told the others this long ago
LOST_GRACE_S = 30.0  # a member that still answers is removed this long after its node went missing
REFUSED_FOR_S = 300.0  # a node whose start of a member failed is not asked again for this long


# -- records ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberRecord:
    """``etcd/members/<node>``: the member of the job's etcd that a node's agent runs."""

    node_id: str
    name: str  # the member's etcd name
    peer_url: str  # how the other members reach it (etcd's member list names it by this)
    client_url: str
    pid: int  # the agent that runs it: a node id with another pid is another agent (the member is gone)
    host: str
    member_id: int = 0  # 0 until etcd added it
    time: float = 0.0
    leaving: bool = False  # its node left the job: the member serves only until another node took over

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def member_record(value: Any) -> MemberRecord:
    """The check of ``etcd/members/<node>``."""
    d = records.obj(value)
    return MemberRecord(
        node_id=records.field(d, "node_id", is_text), name=records.field(d, "name", is_text),
        peer_url=records.field(d, "peer_url", is_text), client_url=records.field(d, "client_url", is_text),
        pid=records.field(d, "pid", is_int), host=records.field(d, "host", is_text),
        member_id=records.field(d, "member_id", is_int, default=0),
        time=records.field(d, "time", is_number, default=0.0),
        leaving=records.field(d, "leaving", records.is_bool, default=False),
    )


@dataclass(frozen=True)
class Assignment:
    """``etcd/assign/<node>``: start a member (``failed``: the node could not, and says why)."""

    node_id: str
    by: str
    time: float
    failed: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def assignment_record(value: Any) -> Assignment:
    """The check of ``etcd/assign/<node>``."""
    d = records.obj(value)
    return Assignment(node_id=records.field(d, "node_id", is_text), by=records.field(d, "by", is_text),
                      time=records.field(d, "time", is_number), failed=records.field(d, "failed", is_text, default=""))


@dataclass(frozen=True)
class Endpoints:
    """``etcd/endpoints``: the client endpoints (``host:port``) of the voting members, and when written."""

    endpoints: Tuple[str, ...]
    time: float

    def to_dict(self) -> Dict[str, Any]:
        return {"endpoints": list(self.endpoints), "time": self.time}


def endpoints_record(value: Any) -> Endpoints:
    """The check of ``etcd/endpoints`` (at least one endpoint)."""
    d = records.obj(value)
    endpoints = records.items(records.field(d, "endpoints", records.is_list), "endpoints", is_text)
    if not endpoints:
        raise records.BadRecord("field 'endpoints': empty")
    return Endpoints(tuple(endpoints), records.field(d, "time", is_number, default=0.0))


# -- the decision -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    most: int = MOST_MEMBERS
    assign_timeout: float = ASSIGN_TIMEOUT_S
    orphan_grace: float = ORPHAN_GRACE_S
    refused_for: float = REFUSED_FOR_S
    settle: float = SETTLE_S
    lost_grace: float = LOST_GRACE_S


@dataclass(frozen=True)
class Snapshot:
    """What the decision looks at, read just before it."""

    members: Tuple[Member, ...]
    records: Dict[str, MemberRecord]  # node id → its member's record
    assignments: Dict[str, Assignment]
    nodes: Dict[str, NodeInfo]  # the live nodes (registered, lease held)
    leader_id: int = 0  # the member etcd's raft leader is (0: unknown)
    ended: bool = False  # the job has its terminal state: nothing changes any more
    first_seen: Dict[int, float] = field(default_factory=dict)  # member id → when the planner first saw it
    refused: Dict[str, float] = field(default_factory=dict)  # node id → when its start of a member failed
    published: Optional[Endpoints] = None  # the endpoints every client was told (etcd/endpoints)
    # Members whose node is missing: member id → (since when the planner misses the node, whether it answers).
    missing: Dict[int, Tuple[float, bool]] = field(default_factory=dict)


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Remove:
    """Remove a member from etcd (its node is gone, it is nobody's, or there are more than the nodes allow)."""

    member_id: int
    name: str
    reason: str


@dataclass(frozen=True)
class Assign:
    """Ask a node to start a member."""

    node_id: str
    reason: str


@dataclass(frozen=True)
class DropAssignment:
    node_id: str
    reason: str
    failed: bool = False  # the node said it could not: ask it no more for a while


@dataclass(frozen=True)
class DropRecord:
    node_id: str
    reason: str


Action = Union[Wait, Remove, Assign, DropAssignment, DropRecord]


def target_size(live_nodes: int, most: int = MOST_MEMBERS) -> int:
    """How many members the job's etcd should have: the largest odd number up to ``most`` and the live
    nodes, at least 1 (two members survive no loss that one would not: either one's loss stops both)."""
    n = max(1, min(most, live_nodes))
    return n if n % 2 else n - 1


def owner(member: Member, snap: Snapshot) -> Optional[MemberRecord]:
    """The record naming ``member`` (by its peer URL), whatever its node's state."""
    for rec in snap.records.values():
        if rec.peer_url in member.peer_urls:
            return rec
    return None


def held(rec: Optional[MemberRecord], snap: Snapshot) -> bool:
    """The record's node is live, still runs the agent that started the member, and stays."""
    node = None if rec is None else snap.nodes.get(rec.node_id)
    return node is not None and rec is not None and node.pid == rec.pid and node.host == rec.host and not rec.leaving


def _orphan(snap: Snapshot, settings: Settings, now: float) -> Optional[Action]:
    """A member no live agent runs, voters first (each one lost narrows the quorum): see :func:`_fate`."""
    voters = sum(1 for m in snap.members if not m.learner)
    for m in sorted(snap.members, key=lambda m: m.learner):
        step = _fate(m, owner(m, snap), snap, settings, now, last=voters == 1 and not m.learner)
        if step is not None:
            return step
    return None


def _fate(m: Member, rec: Optional[MemberRecord], snap: Snapshot, settings: Settings, now: float,
          last: bool) -> Optional[Action]:
    """Remove ``m`` when its node is gone (or runs another agent), when no record names it for a while,
    or when it is a learner nobody adds any more; wait while a record may still be on its way (the
    hosting node writes its own at start). The ``last`` voter stays: there is no cluster without it."""
    young = now - snap.first_seen.get(m.member_id, now) < settings.orphan_grace
    name = m.name or (rec.name if rec is not None else str(m.member_id))
    if rec is None:
        return Wait(f"no record names member {name} yet") if young or last else Remove(m.member_id, name,
                                                                                        "no node runs it")
    if last:
        return None
    if not held(rec, snap):
        return _lost(m, rec, snap, settings, now)
    if m.learner and rec.node_id not in snap.assignments and not young:
        return Remove(m.member_id, name, f"node {rec.node_id} did not make it a voting member")
    return None


def _lost(m: Member, rec: MemberRecord, snap: Snapshot, settings: Settings, now: float) -> Action:
    """The agent that ran ``m`` is gone from the job: dead (its node runs another agent, or the member does
    not answer), or it may be an agent whose lease lapsed and that registers again (its member, a process of
    its own, still answers): that one is given ``lost_grace`` s."""
    name = m.name or rec.name
    if rec.leaving:
        return Remove(m.member_id, name, f"its node {rec.node_id} left")
    if rec.node_id in snap.nodes:
        return Remove(m.member_id, name, f"node {rec.node_id} runs another agent now")
    since, answering = snap.missing.get(m.member_id, (now, False))
    if not answering:
        return Remove(m.member_id, name, f"its node {rec.node_id} is gone")
    if now - since >= settings.lost_grace:
        return Remove(m.member_id, name, f"its node {rec.node_id} has been gone for {now - since:.0f} s")
    return Wait(f"node {rec.node_id} is missing; its member {name} still answers")


def _stale_assignment(snap: Snapshot, settings: Settings, now: float) -> Optional[DropAssignment]:
    for node_id, a in sorted(snap.assignments.items()):
        if a.failed:
            return DropAssignment(node_id, f"node {node_id} could not start a member: {a.failed}", failed=True)
        if node_id not in snap.nodes:
            return DropAssignment(node_id, f"node {node_id} is gone")
        if now - a.time >= settings.assign_timeout:
            return DropAssignment(node_id, f"node {node_id} has no voting member after {settings.assign_timeout:.0f} s",
                                  failed=True)
    return None


def _stale_record(snap: Snapshot, settings: Settings, now: float) -> Optional[DropRecord]:
    """A record of a member etcd no longer lists (removed), or of an addition that never happened."""
    listed = {url for m in snap.members for url in m.peer_urls}
    for node_id, rec in sorted(snap.records.items()):
        if rec.peer_url in listed or node_id in snap.assignments:
            continue
        if rec.member_id or node_id not in snap.nodes or now - rec.time >= settings.orphan_grace:
            return DropRecord(node_id, f"etcd has no member {rec.name} (node {node_id})")
    return None


def candidates(snap: Snapshot, settings: Settings, now: float) -> List[NodeInfo]:
    """Live nodes that may start a member, best first: none of theirs is recorded, none failed lately;
    nodes on a machine that holds no member first, then the longest registered."""
    busy_hosts = {snap.nodes[r.node_id].host for r in snap.records.values() if held(r, snap)}
    free = [n for n in snap.nodes.values()
            if n.node_id not in snap.records and now - snap.refused.get(n.node_id, -1e18) >= settings.refused_for]
    return sorted(free, key=lambda n: (n.host in busy_hosts, n.registered_at, n.node_id))


def _resize(snap: Snapshot, settings: Settings, now: float) -> Action:
    """Grow toward :func:`target_size` of the live nodes, or shrink to it. When nodes that could start a
    member are missing (they failed to lately), the size the voters and those candidates allow: two members
    stranded on the way to three survive less than one (either one's loss stops both), so one is removed."""
    voters = [m for m in snap.members if not m.learner and m.started and held(owner(m, snap), snap)]
    holders = {rec.node_id for rec in (owner(m, snap) for m in voters) if rec is not None}
    refused = [n for n in snap.nodes if n not in holders and now - snap.refused.get(n, -1e18) < settings.refused_for]
    full = target_size(len(snap.nodes), settings.most)
    want = min(full, target_size(len(snap.nodes) - len(refused), settings.most))
    if len(voters) < want:
        free = candidates(snap, settings, now)
        if not free:
            return Wait(f"{len(voters)} of {want} members: no other node can start one")
        return Assign(free[0].node_id, f"{len(voters)} of {want} members")
    if len(voters) > want:
        # The newest member that does not lead: removing the leader would cost an election.
        extra = sorted(voters, key=lambda m: (m.member_id == snap.leader_id, -_record_time(m, snap)))[0]
        why = (f"{len(snap.nodes)} node(s) left" if want == full else
               f"no other node can start a member ({len(voters)} of {full})")
        return Remove(extra.member_id, extra.name, f"{why}: {want} member(s) survive more")
    if want < full:
        return Wait(f"{len(voters)} of {full} members: no other node can start one")
    return Wait(f"{len(voters)} member(s) on {len(voters)} node(s)")


def _record_time(member: Member, snap: Snapshot) -> float:
    rec = owner(member, snap)
    return rec.time if rec is not None else 0.0


def plan(snap: Snapshot, settings: Settings, now: float) -> Action:
    """The one change to make now (or Wait). One change at a time: etcd adds one learner at a time, and
    every change is decided again from a fresh read of the member list."""
    if snap.ended:
        return Wait("the job ended")
    if not snap.members:
        return Wait("etcd listed no member")
    step: Optional[Action] = (_orphan(snap, settings, now) or _stale_assignment(snap, settings, now)
                              or _stale_record(snap, settings, now))
    if step is None and snap.assignments:
        step = Wait(f"node {sorted(snap.assignments)[0]} is starting a member")
    if step is None and any(m.learner for m in snap.members):
        step = Wait("a learner catches up")
    step = step or _resize(snap, settings, now)
    return _told_first(step, snap, settings, now) if isinstance(step, Remove) else step


def _told_first(step: Remove, snap: Snapshot, settings: Settings, now: float) -> Action:
    """A voting member is removed only once every client was told another that stays (at least
    ``settle`` s ago): a client that knew only the removed one would be left with none."""
    gone = next((m for m in snap.members if m.member_id == step.member_id), None)
    if gone is None or gone.learner:
        return step
    stays = {url.split("://", 1)[-1].rstrip("/") for m in snap.members if not m.learner and m.started
             and m.member_id != step.member_id for url in m.client_urls}
    told = snap.published
    if told is None or not stays.intersection(told.endpoints) or now - told.time < settings.settle:
        return Wait(f"telling the clients the other members before removing {step.name} ({step.reason})")
    return step


def client_endpoints(snap: Snapshot) -> List[str]:
    """``host:port`` of every started voting member a live agent runs, sorted (what clients talk to).
    Empty when etcd lists none (the caller then keeps what it has)."""
    out = set()
    for m in snap.members:
        if not m.learner and m.started and held(owner(m, snap), snap):
            out.update(url.split("://", 1)[-1].rstrip("/") for url in m.client_urls)
    return sorted(out)


__all__ = ["ASSIGN_TIMEOUT_S", "Action", "Assign", "Assignment", "DropAssignment", "DropRecord", "Endpoints",
           "MOST_MEMBERS", "MemberRecord", "Remove", "Settings", "Snapshot", "Wait", "assignment_record",
           "candidates", "client_endpoints", "endpoints_record", "held", "member_record", "owner", "plan",
           "target_size"]
