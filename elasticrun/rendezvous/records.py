"""The rendezvous records stored in etcd: nodes, members, topologies, rescale events.

Frozen dataclasses with ``to_dict``/``from_dict`` (they travel as JSON through etcd and the
workers' rescale-event file), and their checks (``node_record``, ``topology_record``,
``event_record``: BadRecord says what is wrong) and parsers (``parse_*``: None after reporting a
bad record once), built on :mod:`elasticrun.job.records`. No I/O here.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from elasticrun.job import records
from elasticrun.job.records import BadRecord, is_int, is_number, is_text


class WorkerStatus(str, enum.Enum):
    """What an agent is doing, as shown by ``elasticrun status``."""

    JOINING = "Joining"
    ACTIVE = "Active"
    RESCALING = "Rescaling"
    LEAVING = "Leaving"
    FAILED = "Failed"
    SUCCEEDED = "Succeeded"


class RescaleType(str, enum.Enum):
    """Why a new round was formed."""

    START = "Start"  # the job's first round
    SCALE_UP = "ScaleUp"  # nodes added
    SCALE_DOWN = "ScaleDown"  # nodes left or died
    REPLACE = "Replace"  # a lost node replaced by a newcomer in the same change
    RESTART = "Restart"  # a worker failed; same members


@dataclass(frozen=True)
class NodeInfo:
    """One agent as registered under ``nodes/<node_id>`` (attached to its lease)."""

    node_id: str
    host: str
    addr: str
    nproc: int
    pid: int
    accelerators: List[Dict[str, Any]] = field(default_factory=list)
    status: WorkerStatus = WorkerStatus.JOINING
    waiting_for: int = -1  # round this idle agent is ready to join; -1 while it runs workers
    store_port: int = 0  # port of the c10d TCPStore this agent hosts if it becomes group rank 0
    node_rank: int = -1  # --node-rank: the group rank this node keeps in every round; -1 = any
    inplace: bool = False  # every local worker opted in to in-place re-forming (elasticrun.train.InPlace)
    # A round this node lets form without it (-1: none): its workers crashed and restart, so the survivors
    # re-form in place at once without waiting for them, and it joins the round after (docs/design.md).
    sits_out: int = -1
    registered_at: float = field(default_factory=time.time)
    heartbeat_at: float = field(default_factory=time.time)

    def to_dict(self) -> Dict[str, Any]:
        # A shallow copy (the accelerator entries are flat dicts): dataclasses.asdict's deep copy
        # was a tenth of a simulated agent's CPU (every publish writes the record).
        d = dict(self.__dict__)
        d["accelerators"] = [dict(a) for a in self.accelerators]
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> NodeInfo:
        d = dict(d)
        d["status"] = WorkerStatus(d.get("status", WorkerStatus.JOINING.value))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def replace(self, **changes: Any) -> NodeInfo:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Member:
    """A node's place in one round: its group rank and the global ranks it owns."""

    node_id: str
    host: str
    addr: str
    nproc: int
    group_rank: int
    rank_offset: int  # first global rank of this node
    lease: int = 0  # the etcd lease the node held when the round formed (its incarnation)

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.nproc)

    def to_dict(self) -> Dict[str, Any]:
        # Flat fields only: a plain dict is ~10x faster than dataclasses.asdict's deep copy,
        # which shows at 256 members per topology.
        return {"node_id": self.node_id, "host": self.host, "addr": self.addr, "nproc": self.nproc,
                "group_rank": self.group_rank, "rank_offset": self.rank_offset, "lease": self.lease}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> Member:
        known = _MEMBER_FIELDS  # computed once: a round of thousands of members is parsed member by member
        return cls(**{k: v for k, v in d.items() if k in known})


_MEMBER_FIELDS = frozenset(f.name for f in dataclasses.fields(Member))


def _member_from_dict(m: Dict[str, Any]) -> Member:
    """:meth:`Member.from_dict` by position: a round of thousands of members is read by every agent."""
    return Member(m["node_id"], m["host"], m["addr"], m["nproc"], m["group_rank"], m["rank_offset"], m.get("lease", 0))


@dataclass(frozen=True)
class Topology:
    """One round of the job: immutable once written to ``topology``."""

    round: int
    members: Tuple[Member, ...]
    master_addr: str
    master_port: int
    restart_count: int = 0
    created_at: float = field(default_factory=time.time)
    inplace: Tuple[str, ...] = ()  # members whose workers re-form in place; the others start (INPLACE_JOIN)

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    @property
    def node_ids(self) -> List[str]:
        return [m.node_id for m in self.members]

    def member(self, node_id: str) -> Optional[Member]:
        """The member with this node id (a dict lookup: each agent asks for itself in rounds of thousands)."""
        return self._by_node.get(node_id)

    @functools.cached_property
    def _by_node(self) -> Dict[str, Member]:
        return {m.node_id: m for m in self.members}

    def to_dict(self) -> Dict[str, Any]:
        return {
            "round": self.round,
            "members": [m.to_dict() for m in self.members],
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "restart_count": self.restart_count,
            "created_at": self.created_at,
            **({"inplace": list(self.inplace)} if self.inplace else {}),
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> Topology:
        return cls(
            round=int(d["round"]),
            members=tuple(map(_member_from_dict, d["members"])),
            master_addr=d["master_addr"],
            master_port=int(d["master_port"]),
            restart_count=int(d.get("restart_count", 0)),
            created_at=float(d.get("created_at", 0.0)),
            inplace=tuple(str(n) for n in d.get("inplace", ())),
        )


@dataclass(frozen=True)
class RescaleEvent:
    """A round change: what changed, why and when. Kept in etcd and handed to workers."""

    type: RescaleType
    round: int
    old_members: List[str]
    new_members: List[str]
    old_world_size: int
    new_world_size: int
    reason: str
    restart_count: int = 0
    time: float = field(default_factory=time.time)
    recovers: bool = False  # the round recovers from a worker failure and used a restart for it
    kept: List[str] = field(default_factory=list)  # the members that re-formed in place (Topology.inplace)

    @property
    def added(self) -> List[str]:
        return [n for n in self.new_members if n not in self.old_members]

    @property
    def removed(self) -> List[str]:
        return [n for n in self.old_members if n not in self.new_members]

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["type"] = self.type.value
        d["added"] = self.added
        d["removed"] = self.removed
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> RescaleEvent:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["type"] = RescaleType(d["type"])
        return cls(**d)


# -- parsing records written by other agents (never trusted; see elasticrun.job.records) ---------


def loads_record(value: Any) -> Any:
    """JSON of an etcd value written by another agent, or None when it is not valid JSON
    (too big, not UTF-8, nested too deeply, ...)."""
    try:
        return records.decode(value)
    except records.BadRecord:
        return None


_NODE_FIELDS = (
    ("node_id", is_text), ("host", is_text), ("addr", is_text), ("nproc", is_int), ("pid", is_int),
)
_NODE_OPTIONAL = (
    ("waiting_for", is_int), ("store_port", is_int), ("node_rank", is_int), ("inplace", records.is_bool),
    ("sits_out", is_int),
    ("registered_at", is_number), ("heartbeat_at", is_number), ("accelerators", records.is_list),
)
_STATUSES = frozenset(s.value for s in WorkerStatus)


def node_record(value: Any) -> NodeInfo:
    """A node record (``nodes/<id>``), checked field by field (BadRecord says what is wrong)."""
    d = records.obj(value)
    for name, check in _NODE_FIELDS:
        records.field(d, name, check)
    for name, check in _NODE_OPTIONAL:
        records.field(d, name, check, default=None)
    if d["nproc"] <= 0:
        raise BadRecord(f"field 'nproc': expected a positive integer, got {d['nproc']}")
    if not 0 <= d.get("store_port", 0) < 65536:
        raise BadRecord(f"field 'store_port': {d['store_port']} is not a port")
    if not all(isinstance(a, dict) for a in d.get("accelerators", [])):
        raise BadRecord("field 'accelerators': expected a list of JSON objects")
    if d.get("status", WorkerStatus.JOINING.value) not in _STATUSES:
        raise BadRecord(f"field 'status': {str(d['status'])[:40]!r} is none of {', '.join(sorted(_STATUSES))}")
    return NodeInfo.from_dict(d)


def parse_node(value: Any, key: str = "nodes/?") -> Optional[NodeInfo]:
    """A node record; None when malformed (reported once, see :func:`elasticrun.job.records.parse`)."""
    return records.parse(key, value, node_record)


def _member_ok(m: Member) -> bool:
    """A round member's fields have their types (``type() is``, not generators: a round of
    thousands of members is checked by every agent that reads it)."""
    return (type(m.node_id) is str and type(m.host) is str and type(m.addr) is str  # noqa: E721
            and type(m.nproc) is int and type(m.group_rank) is int  # noqa: E721
            and type(m.rank_offset) is int and type(m.lease) is int  # noqa: E721
            and m.nproc > 0 and m.group_rank >= 0 and m.rank_offset >= 0)


def _member_problem(members: List[Any]) -> str:
    """What is wrong with the first bad member of a round (the slow path, after the fast check failed)."""
    for i, m in enumerate(members):
        if not isinstance(m, dict):
            return f"member {i}: expected a JSON object"
        for name in ("node_id", "host", "addr", "nproc", "group_rank", "rank_offset"):
            check = is_text if name in ("node_id", "host", "addr") else is_int
            try:
                records.field(m, name, check)
                records.field(m, "lease", is_int, default=0)
            except BadRecord as err:
                return f"member {i}: {err}"
        if m["nproc"] <= 0 or m["group_rank"] < 0 or m["rank_offset"] < 0:
            return f"member {i}: nproc, group_rank or rank_offset out of range"
    return "a member is malformed"


def topology_record(value: Any) -> Topology:
    """A round record (``topology``), checked field by field (BadRecord says what is wrong)."""
    d = records.obj(value)
    members = records.field(d, "members", records.is_list)
    round_ = records.field(d, "round", is_int)
    records.field(d, "master_addr", is_text)
    port = records.field(d, "master_port", is_int)
    records.field(d, "restart_count", is_int, default=0)
    records.field(d, "created_at", is_number, default=0.0)
    records.items(records.field(d, "inplace", records.is_list, default=[]), "inplace", is_text)
    if round_ < 0 or not 0 <= port < 65536:
        raise BadRecord(f"round {round_} or master port {port} out of range")
    try:
        topo = Topology.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # a member without its fields
        raise BadRecord(_member_problem(members) if members else str(err)) from None
    if not all(map(_member_ok, topo.members)):
        raise BadRecord(_member_problem(members))
    return topo


def parse_topology(value: Any, key: str = "topology") -> Optional[Topology]:
    """A round record; None when malformed (reported once)."""
    return records.parse(key, value, topology_record)


_EVENT_TYPES = frozenset(t.value for t in RescaleType)


def event_record(value: Any) -> RescaleEvent:
    """A rescale event (``events/<n>``), checked field by field (BadRecord says what is wrong)."""
    d = records.obj(value)
    kind = records.field(d, "type", is_text)
    if kind not in _EVENT_TYPES:
        raise BadRecord(f"field 'type': {kind[:40]!r} is none of {', '.join(sorted(_EVENT_TYPES))}")
    for name in ("round", "old_world_size", "new_world_size"):
        records.field(d, name, is_int)
    for name in ("old_members", "new_members"):
        records.items(records.field(d, name, records.is_list), name, is_text)
    records.field(d, "reason", is_text)
    records.field(d, "restart_count", is_int, default=0)
    records.field(d, "time", is_number, default=0.0)
    records.field(d, "recovers", records.is_bool, default=False)
    records.items(records.field(d, "kept", records.is_list, default=[]), "kept", is_text)
    return RescaleEvent.from_dict(d)


def parse_event(value: Any, key: str = "events/?") -> Optional[RescaleEvent]:
    """A rescale event; None when malformed (reported once)."""
    return records.parse(key, value, event_record)


__all__ = ["Member", "NodeInfo", "RescaleEvent", "RescaleType", "Topology", "WorkerStatus", "event_record",
           "loads_record", "node_record", "parse_event", "parse_node", "parse_topology", "topology_record"]
