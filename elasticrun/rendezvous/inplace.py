"""Which members of a new round re-form in place (see docs/design.md, "In-place re-forming"). Pure.

A planned change only: a join (``ScaleUp``) or a graceful leave (``ScaleDown`` where every removed
node wrote ``rounds/<n>/left/<node>`` before revoking its lease), with no worker failure, and every
survivor's agent reported that all its workers opted in (:class:`~elasticrun.rendezvous.records.NodeInfo`
``inplace``). All survivors re-form or none does: a crash, a lost node (lease expiry), a hang, a
replacement, or one survivor without opt-in keeps the restart path for the whole round.

A round whose in-place re-form failed (a worker exited :data:`~elasticrun.job.inplace.EXIT_INPLACE_FAILED`,
its agent gave up waiting, or a worker failed inside the re-form: its agent flags the failure row
:data:`~elasticrun.job.inplace.DURING_INPLACE` from its own re-form's progress, never from clocks)
falls back to the restart path *without* using a restart: the change was planned, and the next
round is never in place (it follows a failure), so this cannot loop.

Both decisions take the records already read (the leader's view holds them, see
:mod:`elasticrun.rendezvous.plan`).
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping, Optional, Sequence, Tuple

from elasticrun.job.inplace import DURING_INPLACE, EXIT_INPLACE_FAILED
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleType, Topology


def plan_inplace(
    prev: Optional[Topology],
    members: Sequence[Member],
    kind: RescaleType,
    failed: bool,
    nodes: Mapping[str, Tuple[NodeInfo, int]],
    left: Collection[str],
) -> Tuple[str, ...]:
    """The node ids of ``members`` that keep their workers (empty: every member starts workers).

    ``nodes``: node id → (NodeInfo, lease) as the leader sees them; ``left``: the nodes that wrote a
    graceful-leave marker for round ``prev`` (``rounds/<n>/left/<node>``).
    """
    if prev is None or failed or kind not in (RescaleType.SCALE_UP, RescaleType.SCALE_DOWN):
        return ()
    old = {(m.node_id, m.lease) for m in prev.members}
    survivors = [m.node_id for m in members if (m.node_id, m.lease) in old]
    removed = {m.node_id for m in prev.members} - {m.node_id for m in members}
    if not survivors or not removed <= set(left):
        return ()
    if not all(n in nodes and nodes[n][0].inplace for n in survivors):
        return ()
    if members[0].node_id not in survivors:  # the state is broadcast from rank 0: it must be a survivor
        return ()
    return tuple(survivors)


def inplace_failed(prev: Optional[Topology], failure_rows: Iterable[Mapping[str, Any]]) -> bool:
    """True when round ``prev`` re-formed in place and failed in that re-form: a failure row with exit
    code :data:`EXIT_INPLACE_FAILED` or flagged :data:`DURING_INPLACE` by its agent (the worker failed
    between its assignment and re-forming, or as a newcomer before it had the state). The restart that
    follows is not charged to the budget. ``failure_rows``: every node's failed workers of round ``prev``.
    No clock is read: a failure after the re-form, or of a survivor still training in the old group,
    is charged like any failure."""
    if prev is None or not prev.inplace:
        return False
    return any(row.get("exitcode") == EXIT_INPLACE_FAILED or row.get(DURING_INPLACE) is True for row in failure_rows)


__all__ = ["plan_inplace", "inplace_failed"]
