"""DataRedistributionPlan: which node owns which data shard after a membership change.

Two strategies (:class:`~elasticrun.models.RedistributionType`):

- ``FullReshuffle``: forget the old owners and cut the shard list (in shard-id order)
  into one contiguous, balanced block per new node. Simple and locality-friendly, but
  most shards usually move.
- ``Incremental``: surviving nodes keep what they hold; only the shards of lost nodes
  (and never-assigned shards) move, plus the minimum number of a survivor's shards
  needed to give newcomers a fair share. The moves are the fewest that reach balance.

Either way the result is balanced by shard count (any two nodes differ by at most one
shard) and comes with the transfers that realise it. A transfer's ``priority`` is 0 when
nobody is working on the shard until it arrives (its old owner is gone, or it had none:
read it from storage) and 1 when it is a rebalancing move off a live node that can keep
serving it meanwhile; lower numbers should be scheduled first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from elasticrun.errors import ConfigError
from elasticrun.models import DataShard, RedistributionType

ShardsLike = Union[Sequence[DataShard], Sequence[int], int]


def make_shards(num_samples: int, num_shards: int) -> List[DataShard]:
    """Cut ``[0, num_samples)`` into ``num_shards`` contiguous shards whose sizes differ by at most one."""
    if num_shards < 1 or num_samples < 0:
        raise ConfigError(f"need num_shards >= 1 and num_samples >= 0 (got {num_shards}, {num_samples})")
    base, extra = divmod(num_samples, num_shards)
    shards, start = [], 0
    for i in range(num_shards):
        size = base + (1 if i < extra else 0)
        shards.append(DataShard(shard_id=i, start=start, stop=start + size))
        start += size
    return shards


def _shard_ids(shards: ShardsLike) -> List[int]:
    if isinstance(shards, int):
        return list(range(shards))
    return [s.shard_id if isinstance(s, DataShard) else int(s) for s in shards]


@dataclass(frozen=True)
class Transfer:
    """Move ``shard`` to ``destination``; ``source`` is the old owner (None if it had none)."""

    shard: int
    destination: str
    source: Optional[str]
    priority: int

    def to_dict(self) -> Dict[str, Any]:
        return {"shard": self.shard, "destination": self.destination, "source": self.source,
                "priority": self.priority}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Transfer:
        return cls(shard=int(d["shard"]), destination=d["destination"], source=d.get("source"),
                   priority=int(d["priority"]))


@dataclass
class DataRedistributionPlan:
    """New owner of every shard plus the transfers from the old assignment; see the module doc."""

    kind: RedistributionType
    shards: List[int]
    nodes: List[str]
    assignments: Dict[str, List[int]]
    transfers: List[Transfer] = field(default_factory=list)
    old_assignments: Dict[str, List[int]] = field(default_factory=dict)

    # -- construction ---------------------------------------------------------------

    @classmethod
    def build(
        cls,
        shards: ShardsLike,
        old_assignments: Optional[Mapping[str, Iterable[int]]],
        new_nodes: Sequence[str],
        kind: Union[RedistributionType, str] = RedistributionType.INCREMENTAL,
    ) -> DataRedistributionPlan:
        """Plan the move from ``old_assignments`` (node → shard ids; may be empty) to ``new_nodes``.

        Raises :class:`ConfigError` for an empty or duplicated node list, duplicated shard
        ids, or an old assignment that names unknown shards or a shard twice.
        """
        kind = RedistributionType(kind) if not isinstance(kind, RedistributionType) else kind
        ids = _shard_ids(shards)
        nodes = list(new_nodes)
        if not nodes:
            raise ConfigError("cannot redistribute data onto an empty node list")
        _no_duplicates(nodes, "node")
        _no_duplicates(ids, "shard id")
        old = {n: list(s) for n, s in (old_assignments or {}).items()}
        known = set(ids)
        owner: Dict[int, str] = {}
        for node, held in old.items():
            for sid in held:
                if sid not in known:
                    raise ConfigError(f"old assignment gives node {node!r} shard {sid}, which is not in the shard list")
                if sid in owner:
                    raise ConfigError(f"old assignment gives shard {sid} to both {owner[sid]!r} and {node!r}")
                owner[sid] = node
        if kind is RedistributionType.FULL_RESHUFFLE:
            assignments = _contiguous(sorted(ids), nodes)
        else:
            assignments = _incremental(ids, old, nodes)
        transfers = _transfers(assignments, owner, set(nodes))
        return cls(kind=kind, shards=ids, nodes=nodes, assignments=assignments, transfers=transfers,
                   old_assignments=old)

    # -- queries --------------------------------------------------------------------

    def owner_of(self, shard: int) -> str:
        for node, held in self.assignments.items():
            if shard in held:
                return node
        raise KeyError(shard)

    @property
    def moved(self) -> int:
        """How many shards change owner."""
        return len(self.transfers)

    def incoming(self, node: str) -> List[Transfer]:
        """Transfers ``node`` receives, most urgent first."""
        return sorted((t for t in self.transfers if t.destination == node), key=lambda t: (t.priority, t.shard))

    def outgoing(self, node: str) -> List[Transfer]:
        """Transfers ``node`` sends (it must be alive to do so)."""
        return sorted((t for t in self.transfers if t.source == node), key=lambda t: (t.priority, t.shard))

    def samples_of(self, node: str, shards: Sequence[DataShard]) -> List[int]:
        """Sample indices ``node`` owns, given the shard definitions."""
        by_id = {s.shard_id: s for s in shards}
        return [i for sid in self.assignments.get(node, []) for i in range(by_id[sid].start, by_id[sid].stop)]

    # -- validation -----------------------------------------------------------------

    def validate(self) -> None:
        """Raise :class:`ConfigError` unless every shard is assigned exactly once to a node of the
        plan, loads differ by at most one shard, and the transfers are exactly the owner changes."""
        node_set = set(self.nodes)
        stray = sorted(set(self.assignments) - node_set)
        if stray:
            raise ConfigError(f"plan assigns shards to nodes outside the new node list: {stray}")
        counts = Counter(sid for held in self.assignments.values() for sid in held)
        dup = sorted(sid for sid, c in counts.items() if c > 1)
        if dup:
            raise ConfigError(f"plan assigns shard(s) {dup[:10]} more than once")
        missing = sorted(set(self.shards) - set(counts))
        if missing:
            raise ConfigError(f"plan leaves shard(s) {missing[:10]} unassigned ({len(missing)} in all)")
        unknown = sorted(set(counts) - set(self.shards))
        if unknown:
            raise ConfigError(f"plan assigns unknown shard(s) {unknown[:10]}")
        loads = {n: len(self.assignments.get(n, [])) for n in self.nodes}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > 1:
            heavy = max(loads, key=loads.__getitem__)
            light = min(loads, key=loads.__getitem__)
            raise ConfigError(
                f"plan is unbalanced: node {heavy!r} has {hi} shards but {light!r} has {lo} (must differ by <= 1)"
            )
        old_owner = {sid: n for n, held in self.old_assignments.items() for sid in held}
        expected = {sid for n, held in self.assignments.items() for sid in held if old_owner.get(sid) != n}
        seen = Counter(t.shard for t in self.transfers)
        if set(seen) != expected or any(c > 1 for c in seen.values()):
            raise ConfigError(
                f"plan transfers do not match the owner changes: {len(expected)} shards change owner, "
                f"{len(self.transfers)} transfers listed"
            )
        for t in self.transfers:
            if t.shard not in self.assignments.get(t.destination, []):
                raise ConfigError(f"transfer of shard {t.shard} goes to {t.destination!r}, which does not own it")
            if t.source != old_owner.get(t.shard):
                raise ConfigError(f"transfer of shard {t.shard} names source {t.source!r}, not its old owner")

    # -- serialisation --------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        return {
            "kind": self.kind.value,
            "shards": list(self.shards),
            "nodes": list(self.nodes),
            "assignments": {n: list(s) for n, s in self.assignments.items()},
            "transfers": [t.to_dict() for t in self.transfers],
            "old_assignments": {n: list(s) for n, s in self.old_assignments.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataRedistributionPlan:
        return cls(
            kind=RedistributionType(d["kind"]),
            shards=[int(s) for s in d["shards"]],
            nodes=list(d["nodes"]),
            assignments={n: [int(s) for s in v] for n, v in d["assignments"].items()},
            transfers=[Transfer.from_dict(t) for t in d.get("transfers", [])],
            old_assignments={n: [int(s) for s in v] for n, v in d.get("old_assignments", {}).items()},
        )


def _no_duplicates(items: Sequence[Any], what: str) -> None:
    dup = sorted({str(x) for x, c in Counter(items).items() if c > 1})
    if dup:
        raise ConfigError(f"duplicate {what}(s): {', '.join(dup[:10])}")


def _targets(nodes: Sequence[str], total: int, current: Mapping[str, int]) -> Dict[str, int]:
    """Balanced loads; the ``total % len(nodes)`` extra shards go to nodes already holding most."""
    base, extra = divmod(total, len(nodes))
    order = sorted(range(len(nodes)), key=lambda i: (-current.get(nodes[i], 0), i))
    bonus = set(order[:extra])
    return {n: base + (1 if i in bonus else 0) for i, n in enumerate(nodes)}


def _contiguous(ids: List[int], nodes: Sequence[str]) -> Dict[str, List[int]]:
    targets = _targets(nodes, len(ids), {})
    out, pos = {}, 0
    for n in nodes:
        out[n] = ids[pos : pos + targets[n]]
        pos += targets[n]
    return out


def _incremental(ids: List[int], old: Mapping[str, List[int]], nodes: Sequence[str]) -> Dict[str, List[int]]:
    keep = {n: list(old.get(n, [])) for n in nodes}
    held = {sid for v in keep.values() for sid in v}
    pool = [sid for sid in ids if sid not in held]  # lost nodes' shards and never-assigned ones
    targets = _targets(nodes, len(ids), {n: len(v) for n, v in keep.items()})
    for n in nodes:  # survivors over their target give up their last shards
        excess = len(keep[n]) - targets[n]
        if excess > 0:
            pool.extend(keep[n][-excess:])
            del keep[n][-excess:]
    pool.sort()
    for n in nodes:
        need = targets[n] - len(keep[n])
        if need > 0:
            keep[n].extend(pool[:need])
            del pool[:need]
    assert not pool, "balanced targets must absorb every shard"
    return keep


def _transfers(assignments: Mapping[str, List[int]], owner: Mapping[int, str], alive: set) -> List[Transfer]:
    out = []
    for node, held in assignments.items():
        for sid in held:
            src = owner.get(sid)
            if src != node:
                out.append(Transfer(shard=sid, destination=node, source=src,
                                    priority=1 if src in alive else 0))
    out.sort(key=lambda t: (t.priority, t.destination, t.shard))
    return out


__all__ = ["DataRedistributionPlan", "Transfer", "make_shards"]
