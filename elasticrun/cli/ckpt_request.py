"""``elasticrun ckpt save --rdzv-id``'s side of the checkpoint-request protocol: ask, then wait.

The keys, records and the rule for a job that cannot answer are the contract
(:mod:`elasticrun.job.requests`); this module reads and writes them in etcd.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Tuple

from elasticrun.errors import CheckpointError, ConfigError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.job.requests import answer_record, new_request_id, request_body, why_gone
from elasticrun.store.client import EtcdStore
from elasticrun.store.types import KeyValue


def _job_gone(store: EtcdStore, keys: JobKeys) -> Optional[str]:
    """Why job ``keys`` cannot answer a request any more (it ended, or no agent runs it), or None."""
    state = records.read(store.get(keys.state), records.state_record)  # a malformed one counts as absent
    running = len(store.get_prefix(keys.nodes)[0]) if state is None else 0
    return why_gone(keys.job_id, state, running)


def request_checkpoint(store: EtcdStore, job_id: str, timeout: float, where: str = "") -> Dict[str, Any]:
    """Ask job ``job_id`` to checkpoint now and wait (watch) for rank 0's answer.

    Raises ConfigError when the job has no keys, CheckpointError at once when the job has
    finished (or no agent of it runs), when it ends while we wait, when it did not answer within
    ``timeout`` (the request is withdrawn) or answered with an error. The request and its answer
    are deleted once read (rank 0 also puts its answer on a lease: a reader that died leaves
    nothing behind for long).
    """
    keys = JobKeys(job_id)
    rid = new_request_id()
    if store.get(keys.config) is None and not store.get_prefix(keys.prefix)[0]:
        raise ConfigError(f"no job {job_id!r} in etcd{where}: check --rdzv-id (see `elasticrun status`)")
    gone = _job_gone(store, keys)
    if gone:
        raise CheckpointError(f"{gone}: nothing to checkpoint")
    store.put_json(keys.checkpoint_request(rid), request_body(rid))
    try:
        kv, gone = _wait_answer(store, keys, rid, timeout)
    finally:
        store.delete(keys.checkpoint_request(rid))  # answered, withdrawn or abandoned: never left behind
    if kv is None:
        if gone:
            raise CheckpointError(f"{gone} before it checkpointed (request withdrawn)")
        raise CheckpointError(
            f"job {job_id!r} did not checkpoint within {timeout:g}s (request withdrawn): is it running and "
            "calling the elasticrun checkpoint hook? see `elasticrun status`"
        )
    store.delete(keys.checkpoint_answer(rid))
    try:
        answer = answer_record(records.decode(kv.value))
    except records.BadRecord as err:
        raise CheckpointError(f"job {job_id!r} answered with a malformed record ({err}): {kv.value[:100]!r}") from None
    if answer.get("error"):
        raise CheckpointError(f"job {job_id!r} could not checkpoint: {answer['error']}")
    return answer


def _wait_answer(store: EtcdStore, keys: JobKeys, rid: str, timeout: float) -> Tuple[Optional[KeyValue], str]:
    """(rank 0's answer, '') — or (None, why the job cannot answer) when it ends or loses its nodes
    meanwhile, or (None, '') after ``timeout``. Watches the answer, the job's state and its nodes."""
    changed = threading.Event()
    cancels = [
        store.watch_prefix(key, lambda _ev: changed.set(), lambda _err: changed.set())
        for key in (keys.checkpoint_answer(rid), keys.state, keys.nodes)
    ]
    try:
        deadline = time.monotonic() + timeout
        while True:
            changed.clear()
            kv = store.get(keys.checkpoint_answer(rid))
            if kv is not None:
                return kv, ""
            gone = _job_gone(store, keys)
            if gone:
                return None, gone
            left = deadline - time.monotonic()
            if left <= 0:
                return None, ""
            changed.wait(min(left, 5.0))
    finally:
        for cancel in cancels:
            cancel()


__all__ = ["request_checkpoint"]
