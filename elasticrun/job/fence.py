"""The commit fence: a worker of a stale round never publishes a checkpoint.

Every worker knows its round (``ELASTICRUN_ROUND``), its job (``ELASTICRUN_RDZV_ID``)
and how to reach the job's etcd (:class:`~elasticrun.job.settings.EtcdSettings`, from the
agent's settings file). Right before the commit — after the shards and ``metadata.json`` are
written and synced, just before the rename that makes the checkpoint visible — the committing
rank reads the job's current round (:attr:`JobKeys.fence`); if a newer round exists (this
worker's node was presumed dead, e.g. frozen past its lease) or etcd cannot confirm it, the
save is refused and rolled back. What remains between that read and the rename (a few system
calls; a process frozen exactly there) is closed on the storage side: a save's temporary
directory records :func:`fence_identity`, and a newer round's rank 0 renames the older rounds'
temporary directories aside when it opens the root (``checkpoint.temps.fence_older_saves``),
so the late rename finds nothing to publish. Outside elasticrun this is a no-op.

One newer round does not fence: the round an in-place re-form of this worker's node is pending
for (docs/design.md, "In-place re-forming"). Between the leader writing that round and the
survivors re-forming into it (up to ``--inplace-ready-timeout`` while newcomers start), the
survivors still train in the old group and are the job: their saves commit, as long as their
node still holds the lease the new round names it with (a node that lost its lease is stale).
:func:`fence_verdict` is that decision, apart from the reads.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from elasticrun.errors import CheckpointError, ElasticrunError
from elasticrun.job import env as names
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.job.settings import EtcdSettings

if TYPE_CHECKING:
    from elasticrun.store.client import EtcdStore

#: Seconds the fence waits for etcd before refusing the commit.
FENCE_TIMEOUT = 3.0


def fenced_round(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This worker's round when the commit fence applies (under elasticrun with etcd), else None."""
    env = os.environ if env is None else env
    mine = env.get(names.ROUND, "").strip()
    if not (mine and env.get(names.RDZV_ID, "").strip() and EtcdSettings.from_env(env)):
        return None
    return int(mine)


def fence_identity(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, int]]:
    """``(job id, round)`` of this worker when the commit fence applies, else None: what a save's
    temporary directory records so that a newer round can fence it (``checkpoint.temps``)."""
    env = os.environ if env is None else env
    mine = fenced_round(env)
    return None if mine is None else (env[names.RDZV_ID].strip(), mine)


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


def needs_node_lease(mine: int, node_id: str, topology: Any) -> bool:
    """Whether :func:`fence_verdict` needs the node's lease: only for a pending in-place re-form."""
    try:
        current = current_round(topology)
        return current is not None and current == mine + 1 and bool(node_id) and node_id in _inplace(topology)
    except records.BadRecord:
        return False  # the verdict reports it


def _members(topology: Any) -> List[Dict[str, Any]]:
    return [m for m in records.field(records.obj(topology), "members", records.is_list, default=[])
            if isinstance(m, dict)]


def _inplace(topology: Any) -> List[str]:
    return [str(n) for n in records.field(records.obj(topology), "inplace", records.is_list, default=[])]


def current_round(topology: Any) -> Optional[int]:
    """The round recorded at the fence key's decoded value (None when the job has no topology);
    BadRecord when it has no integer ``round``."""
    if topology is None:
        return None
    return records.field(records.obj(topology), "round", records.is_int)


_lock = threading.Lock()
_cached: Optional[Tuple[int, EtcdSettings, str, EtcdStore]] = None  # (pid, settings, job, client)


def _read_fence(settings: EtcdSettings, job_id: str, node_id: str, mine: int) -> Tuple[Any, Optional[int]]:
    """The fence key's value and, when an in-place re-form of ``node_id`` is pending, the lease of
    its node record; through a client kept for this process's next commits (a TLS + auth
    connection costs ~0.25 s: a TLS handshake and a bcrypt password check in etcd). A client made
    before a fork is never used in the child; after an error the next commit connects afresh."""
    global _cached
    with _lock:
        store = None
        if _cached is not None and _cached[0] == os.getpid() and _cached[1:3] == (settings, job_id):
            store = _cached[3]
        else:
            if _cached is not None and _cached[0] == os.getpid():
                _cached[3].close()
            _cached = None
        if store is None:
            store = settings.connect(job_id, retry_timeout=FENCE_TIMEOUT, timeout=FENCE_TIMEOUT)
            _cached = (os.getpid(), settings, job_id, store)
        keys = JobKeys(job_id)
        try:
            kv = store.get(keys.fence)
            lease = None
            if kv is not None and needs_node_lease(mine, node_id, _decoded(kv)):
                node = store.get(keys.node(node_id))
                lease = None if node is None else node.lease
            return kv, lease
        except ElasticrunError:
            store.close()
            _cached = None
            raise


def _decoded(kv: Any) -> Any:
    try:
        return records.decode(kv.value)
    except records.BadRecord:
        return None  # reported by the caller's own decode


def check_round_is_current(env: Optional[Mapping[str, str]] = None) -> None:
    """Raise CheckpointError unless this worker's round is still the job's current round."""
    env = os.environ if env is None else env
    mine = fenced_round(env)
    if mine is None:
        return
    job_id = env[names.RDZV_ID].strip()
    settings = EtcdSettings.from_env(env)
    assert settings is not None
    node_id = env.get(names.NODE_ID, "").strip()
    try:
        kv, node_lease = _read_fence(settings, job_id, node_id, mine)
    except ElasticrunError as err:
        raise CheckpointError(f"cannot confirm that round {mine} is still current ({err}); not committing") from None
    try:
        why = fence_verdict(mine, node_id, None if kv is None else records.decode(kv.value), node_lease)
    except records.BadRecord as err:
        records.report(kv.key, str(err))
        raise CheckpointError(
            f"cannot confirm that round {mine} is still current (the round record at {kv.key} is malformed: "
            f"{err}); not committing"
        ) from None
    if why is not None:
        raise CheckpointError(
            f"this worker belongs to round {mine}, which is no longer current: {why}; a stale round must not "
            "commit a checkpoint; not committing"
        )


__all__ = ["FENCE_TIMEOUT", "check_round_is_current", "current_round", "fence_identity", "fence_verdict",
           "fenced_round", "needs_node_lease"]
