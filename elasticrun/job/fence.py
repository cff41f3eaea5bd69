"""The commit fence: a worker of a stale round never publishes a checkpoint.

Every worker knows its round (``ELASTICRUN_ROUND``), its job (``ELASTICRUN_RDZV_ID``)
and how to reach the job's etcd (the agent's settings file, :mod:`elasticrun.job.settings`).
Right before the commit — after the shards and ``metadata.json`` are written and synced, just
before the rename that makes the checkpoint visible — the committing rank reads the job's current
round (:attr:`JobKeys.fence`); if a newer round exists (this worker's node was presumed dead, e.g.
frozen past its lease) or etcd cannot confirm it, the save is refused and rolled back. What remains
between that read and the rename (a few system calls; a process frozen exactly there) is closed on
the storage side: a save's temporary directory records :func:`fence_identity`, and a newer round's
rank 0 renames the older rounds' temporary directories aside when it opens the root
(``checkpoint.temps.fence_older_saves``), so the late rename finds nothing to publish. Outside
elasticrun this is a no-op.

One newer round does not fence: the round an in-place re-form of this worker's node is pending
for (docs/design.md, "In-place re-forming"). Between the leader writing that round and the
survivors re-forming into it (up to ``--inplace-ready-timeout`` while newcomers start), the
survivors still train in the old group and are the job: their saves commit, as long as their
node still holds the lease the new round names it with (a node that lost its lease is stale).
:func:`fence_verdict` is that decision.

This module is the contract (who is fenced, how the round record is read and judged); the etcd
read is :mod:`elasticrun.train.fence`, which the checkpoint writer calls through
:mod:`elasticrun.checkpoint.fence`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from elasticrun.job import env as names
from elasticrun.job import records
from elasticrun.job.settings import from_env


def fenced_round(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This worker's round when the commit fence applies (under elasticrun with etcd), else None."""
    env = os.environ if env is None else env
    mine = env.get(names.ROUND, "").strip()
    if not (mine and env.get(names.RDZV_ID, "").strip() and from_env(env)):
        return None
    return int(mine)


def fence_identity(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, int]]:
    """``(job id, round)`` of this worker when the commit fence applies, else None: what a save's
    temporary directory records so that a newer round can fence it (``checkpoint.temps``)."""
    env = os.environ if env is None else env
    mine = fenced_round(env)
    return None if mine is None else (env[names.RDZV_ID].strip(), mine)


def current_round(topology: Any) -> Optional[int]:
    """The round recorded at the fence key's decoded value (None when the job has no topology);
    BadRecord when it has no integer ``round``."""
    if topology is None:
        return None
    return records.field(records.obj(topology), "round", records.is_int)


def fence_verdict(mine: int, node_id: str, topology: Any, node_lease: Optional[int]) -> Optional[str]:
    """Why a worker of round ``mine`` on node ``node_id`` must not commit (None: it may).

    ``topology``: the decoded fence record (None: the job has none); ``node_lease``: the lease that
    holds the node's record now (None: no record), read only when the in-place case needs it (see
    :func:`needs_node_lease`). Raises :class:`~elasticrun.job.records.BadRecord` for a malformed record.
    """
    current = current_round(topology)
    if current == mine:
        return None
    if current is None:
        return "the job has no current round"
    if current < mine:
        return f"the job is at round {current}, older than this worker's"
    members = {str(m.get("node_id")): m.get("lease") for m in _members(topology)}
    if node_id not in members:
        return f"round {current} does not include this node (it left or lost its lease)"
    if current > mine + 1:
        return f"the job moved on to round {current}"
    if node_id not in _inplace(topology):
        return f"round {current} restarted this node's workers"
    if node_lease is None or node_lease != members[node_id]:
        return f"this node lost the lease round {current} names it with"
    return None  # its in-place re-form into round ``mine + 1`` is pending: still the job


def needs_node_lease(mine: int, node_id: str, value: Optional[bytes]) -> bool:
    """Whether :func:`fence_verdict` needs the node's lease for the fence key's ``value`` (as read
    from etcd): only while an in-place re-form of ``node_id`` into round ``mine + 1`` is pending."""
    try:
        topology = None if value is None else records.decode(value)
        current = current_round(topology)
        return current is not None and current == mine + 1 and bool(node_id) and node_id in _inplace(topology)
    except records.BadRecord:
        return False  # the verdict reports it


def _members(topology: Any) -> List[Dict[str, Any]]:
    return [m for m in records.field(records.obj(topology), "members", records.is_list, default=[])
            if isinstance(m, dict)]


def _inplace(topology: Any) -> List[str]:
    return [str(n) for n in records.field(records.obj(topology), "inplace", records.is_list, default=[])]


def refusal(mine: int, key: str, value: Optional[bytes], node_id: str = "",
            node_lease: Optional[int] = None) -> Optional[str]:
    """Why a worker of round ``mine`` on node ``node_id`` must not commit, given the fence key ``key``
    as read from etcd (``value`` None: absent) and its node record's lease (:func:`needs_node_lease`);
    None when it may. A malformed record is reported (once) and refuses the commit: it cannot
    confirm the round."""
    try:
        why = fence_verdict(mine, node_id, None if value is None else records.decode(value), node_lease)
    except records.BadRecord as err:
        records.report(key, str(err))
        return (f"cannot confirm that round {mine} is still current (the round record at {key} is malformed: "
                f"{err}); not committing")
    if why is not None:
        return (f"this worker belongs to round {mine}, which is no longer current: {why}; a stale round must "
                "not commit a checkpoint; not committing")
    return None


__all__ = ["current_round", "fence_identity", "fence_verdict", "fenced_round", "needs_node_lease", "refusal"]
