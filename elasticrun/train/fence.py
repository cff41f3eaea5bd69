"""The commit fence's etcd read, in the worker: is this worker's round still the job's?

:func:`check_round_is_current` reads the job's round (:attr:`JobKeys.fence`) with the job's
etcd settings and refuses the commit unless it is this worker's (the rule:
:mod:`elasticrun.job.fence`). Importing :mod:`elasticrun.train` installs it as the process's
commit fence (:func:`install`), which every save calls right before it becomes visible
(:mod:`elasticrun.checkpoint.fence`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Mapping, Optional, Tuple

from elasticrun.checkpoint import fence as commit_fence
from elasticrun.errors import CheckpointError, ElasticrunError
from elasticrun.job import env as names
from elasticrun.job.fence import fenced_round, needs_node_lease, refusal
from elasticrun.job.keys import JobKeys
from elasticrun.job.settings import from_env
from elasticrun.store.settings import EtcdSettings

if TYPE_CHECKING:  # the etcd library is imported by the first commit, not by ``import elasticrun.train``
    from elasticrun.store.client import EtcdStore
    from elasticrun.store.types import KeyValue

#: Seconds the fence waits for etcd before refusing the commit.
FENCE_TIMEOUT = 3.0

_lock = threading.Lock()
_cached: Optional[Tuple[int, EtcdSettings, str, EtcdStore]] = None  # (pid, settings, job, client)


def _read_fence(settings: EtcdSettings, job_id: str, node_id: str,
                mine: int) -> Tuple[Optional[KeyValue], Optional[int]]:
    """The fence key's value and, while an in-place re-form of ``node_id`` is pending, the lease of
    its node record (:func:`~elasticrun.job.fence.needs_node_lease`). Through a client kept for this
    process's next commits (a TLS + auth connection costs ~0.25 s: a TLS handshake and a bcrypt
    password check in etcd). A client made before a fork is never used in the child; after an error
    the next commit connects afresh."""
    global _cached
    keys = JobKeys(job_id)
    with _lock:
        store = None
        if _cached is not None and _cached[0] == os.getpid() and _cached[1:3] == (settings, job_id):
            store = _cached[3]
        else:
            if _cached is not None and _cached[0] == os.getpid():
                _cached[3].close()
            _cached = None
        if store is None:
            store = settings.connect(keys.ping, retry_timeout=FENCE_TIMEOUT, timeout=FENCE_TIMEOUT)
            _cached = (os.getpid(), settings, job_id, store)
        try:
            kv = store.get(keys.fence)
            lease = None
            if kv is not None and needs_node_lease(mine, node_id, kv.value):
                node = store.get(keys.node(node_id))
                lease = None if node is None else node.lease
            return kv, lease
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
    settings = from_env(env)
    assert settings is not None
    node_id = env.get(names.NODE_ID, "").strip()
    try:
        kv, node_lease = _read_fence(settings, job_id, node_id, mine)
    except ElasticrunError as err:
        raise CheckpointError(f"cannot confirm that round {mine} is still current ({err}); not committing") from None
    why = refusal(mine, JobKeys(job_id).fence if kv is None else kv.key, None if kv is None else kv.value, node_id,
                  node_lease)
    if why is not None:
        raise CheckpointError(why)


def install() -> None:
    """Make :func:`check_round_is_current` this process's commit fence."""
    commit_fence.install(check_round_is_current)


__all__ = ["FENCE_TIMEOUT", "check_round_is_current", "install"]
