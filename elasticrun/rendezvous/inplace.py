"""Which members of a new round re-form in place (see docs/design.md, "In-place re-forming").

A planned change only: a join (``ScaleUp``) or a graceful leave (``ScaleDown`` where every removed
node wrote ``rounds/<n>/left/<node>`` before revoking its lease), with no worker failure, and every
survivor's agent reported that all its workers opted in (:class:`~elasticrun.rendezvous.records.NodeInfo`
``inplace``). All survivors re-form or none does: a crash, a lost node (lease expiry), a hang, a
replacement, or one survivor without opt-in keeps today's restart path for the whole round.

A round whose in-place re-form failed falls back to the restart path *without* using a restart:
the change was planned, and the next round is never in place (it follows a failure), so this cannot
loop. Only what the re-form caused is free (:func:`reform_caused`): a worker that exited
:data:`~elasticrun.job.reform.EXIT_REFORM_FAILED` (or its agent gave up waiting), or one whose agent
flagged its failure row :data:`~elasticrun.job.reform.IN_REFORM` (it failed between its assignment
and re-forming, or as a newcomer before it had the state). Each agent decides that flag from its
own state machine, not from clocks: a crash or hang after the re-form, or of a survivor still
training in the old group, is charged like any failure.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.job.reform import EXIT_REFORM_FAILED, IN_REFORM
from elasticrun.rendezvous.records import Member, RescaleType, Topology
from elasticrun.store.client import EtcdStore


def plan_inplace(
    prev: Optional[Topology],
    members: Sequence[Member],
    kind: RescaleType,
    failed: bool,
    nodes: Dict[str, Any],
    store: EtcdStore,
    keys: JobKeys,
) -> Tuple[str, ...]:
    """The node ids of ``members`` that keep their workers (empty: every member starts workers).

    ``nodes``: node id → (NodeInfo, lease) as the leader sees them; the graceful-leave markers
    of round ``prev`` are read from ``store`` (only for a scale-down).
    """
    if prev is None or failed or kind not in (RescaleType.SCALE_UP, RescaleType.SCALE_DOWN):
        return ()
    old = {(m.node_id, m.lease) for m in prev.members}
    survivors = [m.node_id for m in members if (m.node_id, m.lease) in old]
    removed = {m.node_id for m in prev.members} - {m.node_id for m in members}
    if not survivors:
        return ()
    if removed:
        prefix = keys.lefts(prev.round)
        kvs, _ = store.get_prefix(prefix)
        if not removed <= {kv.key[len(prefix):] for kv in kvs}:
            return ()
    if not all(n in nodes and getattr(nodes[n][0], "inplace", False) for n in survivors):
        return ()
    if members[0].node_id not in survivors:  # the state is broadcast from rank 0: it must be a survivor
        return ()
    return tuple(survivors)


def reform_caused(rows: Iterable[Dict[str, Any]]) -> bool:
    """Whether failure rows of an in-place round show a failure of the re-form itself."""
    return any(r.get("exitcode") == EXIT_REFORM_FAILED or r.get(IN_REFORM) is True for r in rows)


def reform_failed(prev: Optional[Topology], store: EtcdStore, keys: JobKeys) -> bool:
    """True when round ``prev`` re-formed in place and failed in that re-form (:func:`reform_caused`
    over every node's failure rows): the restart that follows is not charged to the budget."""
    if prev is None or not prev.inplace:
        return False
    kvs, _ = store.get_prefix(keys.failures(prev.round))
    return any(reform_caused(records.read(kv, records.failure_rows) or []) for kv in kvs)


__all__ = ["plan_inplace", "reform_caused", "reform_failed"]
