"""Pure round planning: who is in the next round, in which order, and why it changed.

Ranks are stable: nodes that survive keep their relative order (so group rank 0 stays on
the same node whenever it survives); newcomers go after them in the order they joined.
A node started with ``--node-rank R`` (``NodeInfo.node_rank``) gets group rank R whenever the
round has more than R members; the other nodes fill the free places in the order above.
Global ranks are assigned by prefix sum, so nodes may run different worker counts.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from elasticrun.rendezvous.records import Member, NodeInfo, RescaleType, Topology

Candidate = Tuple[NodeInfo, int]  # (node info, lease id of its registration)


def order_candidates(prev: Optional[Topology], candidates: Sequence[Candidate]) -> List[Candidate]:
    """Survivors of ``prev`` first (in their old order), then newcomers by join time."""
    survivors = []
    newcomers = []
    for info, lease in candidates:
        old = prev.member(info.node_id) if prev is not None else None
        if old is not None and old.lease == lease:
            survivors.append((old.group_rank, info, lease))
        else:
            newcomers.append((info.registered_at, info.node_id, info, lease))
    survivors.sort(key=lambda t: t[0])
    newcomers.sort(key=lambda t: (t[0], t[1]))
    return [(i, ls) for _, i, ls in survivors] + [(i, ls) for _, _, i, ls in newcomers]


def place_fixed_ranks(ordered: Sequence[Candidate]) -> List[Candidate]:
    """Put every node with a fixed ``node_rank`` at that place (when it exists); others fill the gaps.

    A fixed rank beyond the round's size (a smaller elastic round) cannot be kept: such nodes
    fill the free places first, in rank order, then the nodes without a fixed rank.
    """
    size = len(ordered)
    slots: List[Optional[Candidate]] = [None] * size
    fixed = sorted((c for c in ordered if c[0].node_rank >= 0), key=lambda c: (c[0].node_rank, c[0].node_id))
    rest: List[Candidate] = []
    for cand in fixed:
        rank = cand[0].node_rank
        if rank < size and slots[rank] is None:
            slots[rank] = cand
        else:
            rest.append(cand)
    rest.extend(c for c in ordered if c[0].node_rank < 0)
    free = iter(rest)
    return [slot if slot is not None else next(free) for slot in slots]


def assign_ranks(ordered: Sequence[Candidate]) -> Tuple[Member, ...]:
    """Group ranks in order; global ranks by prefix sum of each node's worker count."""
    members = []
    offset = 0
    for group_rank, (info, lease) in enumerate(ordered):
        members.append(
            Member(
                node_id=info.node_id,
                host=info.host,
                addr=info.addr,
                nproc=info.nproc,
                group_rank=group_rank,
                rank_offset=offset,
                lease=lease,
            )
        )
        offset += info.nproc
    return tuple(members)


def plan_members(
    prev: Optional[Topology], candidates: Sequence[Candidate], max_nodes: int
) -> Tuple[Tuple[Member, ...], List[str]]:
    """The members of the next round (at most ``max_nodes``) and the spares left waiting."""
    ordered = order_candidates(prev, candidates)
    chosen = place_fixed_ranks(ordered[:max_nodes])
    return assign_ranks(chosen), [info.node_id for info, _ in ordered[max_nodes:]]


def classify(prev: Optional[Topology], members: Sequence[Member], failed: bool) -> RescaleType:
    """What kind of change leads from ``prev`` to ``members``."""
    if prev is None:
        return RescaleType.START
    old = {(m.node_id, m.lease) for m in prev.members}
    new = {(m.node_id, m.lease) for m in members}
    added, removed = new - old, old - new
    if added and removed:
        return RescaleType.REPLACE
    if removed:
        return RescaleType.SCALE_DOWN
    if added:
        return RescaleType.SCALE_UP
    return RescaleType.RESTART
