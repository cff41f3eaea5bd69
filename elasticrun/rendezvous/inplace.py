"""Which members of a new round re-form in place (see docs/design.md, "In-place re-forming"). Pure.

A membership change with no worker failure: a join (``ScaleUp``), or a ``ScaleDown`` by a graceful
leave (the node wrote ``rounds/<n>/left/<node>`` before revoking its lease) or by a lost node (its
lease expired: SIGKILL of the whole node; the survivors' collectives with its dead workers fail,
and ``InPlace.recover`` waits for the re-form). Or a
recovery from a worker crash (``Restart``: the same members under the same leases) where every
failure row is flagged :data:`~elasticrun.job.inplace.RECOVERABLE` by its agent (the crashed node's
workers had all opted in, no re-form was under way): the nodes without a failed worker re-form,
the crashed nodes start their workers again as newcomers. Either way every survivor's agent
reported that all its workers opted in (:class:`~elasticrun.rendezvous.records.NodeInfo`
``inplace``) and rank 0 survives. All survivors re-form or none does: a hang, a replacement, a
crash inside a re-form, a crash together with a lost node, or one survivor without opt-in keeps
the restart path for the whole round. A crash recovered in place uses a restart like any crash (the caller
charges it); only the re-form's own failures are free (:func:`inplace_failed`).

A round whose in-place re-form failed (a worker exited :data:`~elasticrun.job.inplace.EXIT_INPLACE_FAILED`,
its agent gave up waiting, or a worker failed inside the re-form: its agent flags the failure row
:data:`~elasticrun.job.inplace.DURING_INPLACE` from its own re-form's progress, never from clocks)
falls back to the restart path *without* using a restart: the change was planned, and the next
round is never in place (it follows a failure), so this cannot loop.

Both decisions take the records already read (the leader's view holds them, see
:mod:`elasticrun.rendezvous.plan`).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

from elasticrun.job.inplace import DURING_INPLACE, EXIT_INPLACE_FAILED, RECOVERABLE
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleType, Topology


def plan_inplace(
    prev: Optional[Topology],
    members: Sequence[Member],
    kind: RescaleType,
    failed: bool,
    nodes: Mapping[str, Tuple[NodeInfo, int]],
    failure_rows: Iterable[Mapping[str, Any]] = (),
) -> Tuple[str, ...]:
    """The node ids of ``members`` that keep their workers (empty: every member starts workers).

    ``nodes``: node id → (NodeInfo, lease) as the leader sees them; ``failure_rows``: every node's
    failed workers of round ``prev`` (read when it failed).
    """
    if prev is None:
        return ()
    old = {(m.node_id, m.lease) for m in prev.members}
    kept = [m.node_id for m in members if (m.node_id, m.lease) in old]
    if failed:
        survivors = _crash_survivors(prev, kept, kind, failure_rows)
    elif kind in (RescaleType.SCALE_UP, RescaleType.SCALE_DOWN):
        survivors = kept  # a removed node left gracefully or was lost (its lease expired)
    else:
        survivors = []
    if not survivors or not all(n in nodes and nodes[n][0].inplace for n in survivors):
        return ()
    if members[0].node_id not in survivors:  # the state is broadcast from rank 0: it must be a survivor
        return ()
    return tuple(survivors)


def _crash_survivors(prev: Topology, kept: Sequence[str], kind: RescaleType,
                     failure_rows: Iterable[Mapping[str, Any]]) -> List[str]:
    """After a failed round: the members whose workers all still run, when the failure is recoverable in
    place (every failed worker's row flagged :data:`RECOVERABLE`, and no member went but crashed nodes
    sitting the round out: a ``Restart``, or a ``ScaleDown`` without them); else none."""
    rows = list(failure_rows)
    if kind not in (RescaleType.RESTART, RescaleType.SCALE_DOWN) or not rows:
        return []
    if not all(recoverable_in_place(row) for row in rows):
        return []
    crashed = {row.get("node_id") for row in rows}
    if not {m.node_id for m in prev.members} - set(kept) <= crashed:  # a node lost with the crash
        return []
    return [n for n in kept if n not in crashed]


def recoverable_in_place(row: Mapping[str, Any]) -> bool:
    """Whether a failure row's agent flagged it :data:`RECOVERABLE` (and the row names its node)."""
    return row.get(RECOVERABLE) is True and isinstance(row.get("node_id"), str)


def keeps_through_failure(rows: Sequence[Mapping[str, Any]], node_id: str) -> bool:
    """A survivor's agent, at the end of a failed round: keep our workers (they wait in
    ``InPlace.recover``) when every failure row is recoverable in place and none is ours. The leader
    decides with :func:`plan_inplace`; a survivor it does not re-form stops its kept workers then."""
    return bool(rows) and all(recoverable_in_place(row) and row.get("node_id") != node_id for row in rows)


def collectives_broke(failed: bool, lost: Optional[str], left: Iterable[str]) -> bool:
    """Whether a round's end breaks its members' collectives: a worker failed (``failed``), or the member
    the end record names (``lost``) went without a graceful leave's marker (``left``: the nodes that
    wrote ``rounds/<n>/left/<node>``), so its lease expired. A join, a graceful leave or the end for
    newcomers breaks nothing: the workers train on until they re-form."""
    return failed or (lost is not None and lost not in set(left))


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


__all__ = ["collectives_broke", "inplace_failed", "keeps_through_failure", "plan_inplace", "recoverable_in_place"]
