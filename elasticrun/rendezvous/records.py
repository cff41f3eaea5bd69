"""The rendezvous records stored in etcd: nodes, members, topologies, rescale events.

Frozen dataclasses with ``to_dict``/``from_dict`` (they travel as JSON through etcd and the
workers' rescale-event file). No I/O here.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


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
    inplace: Tuple[str, ...] = ()  # members whose workers re-form in place; the others start (REFORM_JOIN)

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


# -- parsing records written by other agents (never trusted) ----------------------------------

_MAX_RECORD = 16 << 20


def loads_record(value: Any) -> Any:
    """JSON of an etcd value written by another agent, or None when it is not valid JSON
    (too big, not UTF-8, nested too deeply, ...)."""
    try:
        if len(value) > _MAX_RECORD:
            return None
        return json.loads(value)
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
        return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_node(value: Any) -> Optional[NodeInfo]:
    """A node record, checked field by field; None when malformed."""
    d = loads_record(value)
    if not isinstance(d, dict):
        return None
    try:
        info = NodeInfo.from_dict(d)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    ok = (all(isinstance(x, str) for x in (info.node_id, info.host, info.addr))
          and all(_is_int(x) for x in (info.nproc, info.pid, info.waiting_for, info.store_port, info.node_rank))
          and info.nproc > 0 and 0 <= info.store_port < 65536 and isinstance(info.accelerators, list)
          and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                  for x in (info.registered_at, info.heartbeat_at)))
    return info if ok else None


def _member_ok(m: Member) -> bool:
    """A round member's fields have their types (``type() is``, not generators: a round of
    thousands of members is checked by every agent that reads it)."""
    return (type(m.node_id) is str and type(m.host) is str and type(m.addr) is str  # noqa: E721
            and type(m.nproc) is int and type(m.group_rank) is int  # noqa: E721
            and type(m.rank_offset) is int and type(m.lease) is int  # noqa: E721
            and m.nproc > 0 and m.group_rank >= 0 and m.rank_offset >= 0)


def parse_topology(value: Any) -> Optional[Topology]:
    """A round record, checked field by field; None when malformed."""
    d = loads_record(value)
    if not isinstance(d, dict) or not isinstance(d.get("members"), list):
        return None
    if not all(isinstance(m, dict) for m in d["members"]):
        return None
    try:
        topo = Topology.from_dict(d)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        return None
    if not all(map(_member_ok, topo.members)):
        return None
    if not isinstance(topo.master_addr, str) or not 0 <= topo.master_port < 65536 or topo.round < 0:
        return None
    return topo


__all__ = ["Member", "NodeInfo", "RescaleEvent", "RescaleType", "Topology", "WorkerStatus", "loads_record",
           "parse_node", "parse_topology"]
