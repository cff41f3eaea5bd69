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

This module is the contract (who is fenced, how the round record is read and judged); the etcd
read is :mod:`elasticrun.train.fence`, which the checkpoint writer calls through
:mod:`elasticrun.checkpoint.fence`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Tuple

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


def refusal(mine: int, key: str, value: Optional[bytes]) -> Optional[str]:
    """Why a worker of round ``mine`` must not commit, given the fence key ``key`` as read from etcd
    (``value`` None: absent); None when its round is the current one. A malformed record is reported
    (once) and refuses the commit: it cannot confirm the round."""
    try:
        current = None if value is None else current_round(records.decode(value))
    except records.BadRecord as err:
        records.report(key, str(err))
        return (f"cannot confirm that round {mine} is still current (the round record at {key} is malformed: "
                f"{err}); not committing")
    if current != mine:
        return (f"this worker belongs to round {mine} but the job is at round {current}: a stale round must not "
                "commit a checkpoint (its node lost its lease); not committing")
    return None


__all__ = ["current_round", "fence_identity", "fenced_round", "refusal"]
