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
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

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


def current_round(topology: Any) -> Optional[int]:
    """The round recorded at the fence key's decoded value (None when the job has no topology);
    BadRecord when it has no integer ``round``."""
    if topology is None:
        return None
    return records.field(records.obj(topology), "round", records.is_int)


_lock = threading.Lock()
_cached: Optional[Tuple[int, EtcdSettings, str, EtcdStore]] = None  # (pid, settings, job, client)


def _read_fence(settings: EtcdSettings, job_id: str) -> Any:
    """The fence key's value, through a client kept for this process's next commits (a TLS + auth
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
        try:
            return store.get(JobKeys(job_id).fence)
        except ElasticrunError:
            store.close()
            _cached = None
            raise


def check_round_is_current(env: Optional[Mapping[str, str]] = None) -> None:
    """Raise CheckpointError unless this worker's round is still the job's current round."""
    env = os.environ if env is None else env
    mine = fenced_round(env)
    if mine is None:
        return
    job_id = env[names.RDZV_ID].strip()
    settings = EtcdSettings.from_env(env)
    assert settings is not None
    try:
        kv = _read_fence(settings, job_id)
    except ElasticrunError as err:
        raise CheckpointError(f"cannot confirm that round {mine} is still current ({err}); not committing") from None
    try:
        current = None if kv is None else current_round(records.decode(kv.value))
    except records.BadRecord as err:
        records.report(kv.key, str(err))
        raise CheckpointError(
            f"cannot confirm that round {mine} is still current (the round record at {kv.key} is malformed: "
            f"{err}); not committing"
        ) from None
    if current != mine:
        raise CheckpointError(
            f"this worker belongs to round {mine} but the job is at round {current}: a stale round must not "
            "commit a checkpoint (its node lost its lease); not committing"
        )


__all__ = ["FENCE_TIMEOUT", "check_round_is_current", "current_round", "fence_identity", "fenced_round"]
