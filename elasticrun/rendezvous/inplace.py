"""Which members of a new round re-form in place (see docs/design.md, "In-place re-forming").

A planned change only: a join (``ScaleUp``) or a graceful leave (``ScaleDown`` where every removed
node wrote ``rounds/<n>/left/<node>`` before revoking its lease), with no worker failure, and every
survivor's agent reported that all its workers opted in (:class:`~elasticrun.rendezvous.records.NodeInfo`
``inplace``). All survivors re-form or none does: a crash, a lost node (lease expiry), a hang, a
replacement, or one survivor without opt-in keeps today's restart path for the whole round.

A round whose in-place re-form failed (a worker exited :data:`~elasticrun.job.inplace.EXIT_INPLACE_FAILED`,
its agent gave up waiting, or any worker failed within :data:`~elasticrun.job.inplace.INPLACE_WINDOW_S`
of the round's start: a newcomer dying while it receives the state) falls back to the restart path
*without* using a restart: the change was planned, and the next round is never in place (it follows
a failure), so this cannot loop.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from elasticrun.job import records
from elasticrun.job.inplace import EXIT_INPLACE_FAILED, INPLACE_WINDOW_S
from elasticrun.job.keys import JobKeys
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


def inplace_failed(prev: Optional[Topology], store: EtcdStore, keys: JobKeys, window: float = INPLACE_WINDOW_S) -> bool:
    """True when round ``prev`` re-formed in place and failed in that re-form (a failure row with
    exit code :data:`EXIT_INPLACE_FAILED`, or the round's failure flag within ``window`` seconds of
    its start: the job's newcomer start-up allowance plus the re-form deadline): the restart that
    follows is not charged to the budget."""
    if prev is None or not prev.inplace:
        return False
    flag = records.read(store.get(keys.failed(prev.round)), records.failed_flag) or {}
    failed_at = float(flag.get("time") or 0)
    if failed_at and failed_at - prev.created_at < window:
        return True
    kvs, _ = store.get_prefix(keys.failures(prev.round))
    for kv in kvs:
        rows = records.read(kv, records.failure_rows) or []
        if any(r.get("exitcode") == EXIT_INPLACE_FAILED for r in rows):
            return True
    return False


__all__ = ["plan_inplace", "inplace_failed"]
