"""The checkpoint-request protocol between ``elasticrun ckpt save --rdzv-id`` and rank 0.

Keys (see :mod:`elasticrun.job.keys`)::

    control/checkpoint/<request_id>       = {"request_id": ..., "requested_at": ...}   written by the CLI
    control/checkpoint-done/<request_id>  = {"name": ..., "root": ..., "step": ...}     written by rank 0
                                          | {"error": "..."}

A request without an answer is pending; the CLI withdraws (deletes) a request it stops
waiting for. Rank 0's side (watching, agreeing across ranks) is
:class:`elasticrun.train.control.CheckpointRequests`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from elasticrun.errors import CheckpointError, ConfigError
from elasticrun.job.keys import JobKeys, last_part

if TYPE_CHECKING:
    from elasticrun.store.client import EtcdStore

log = logging.getLogger(__name__)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def request_body(request_id: str, requested_at: Optional[float] = None) -> Dict[str, Any]:
    return {"request_id": request_id, "requested_at": time.time() if requested_at is None else requested_at}


def answer_done(name: str, root: str, step: int) -> Dict[str, Any]:
    """Rank 0's answer: the checkpoint that satisfied the request."""
    return {"name": name, "root": str(root), "step": int(step)}


def answer_error(error: str) -> Dict[str, Any]:
    """Rank 0's answer: why no checkpoint was made."""
    return {"error": str(error)}


def parse_request(key: str, value: bytes) -> Tuple[str, float]:
    """(request id, requested_at) of a request key; a malformed body still counts as a request."""
    rid = last_part(key)  # the key names the request; the answer goes to the same id
    at = time.time()
    try:
        body = json.loads(value)
        if isinstance(body, dict):
            at = float(body.get("requested_at", at))
    except (ValueError, TypeError):
        log.warning("elasticrun: checkpoint request %s has a malformed body; treating it as a request", key)
    return rid, at


def request_checkpoint(store: EtcdStore, job_id: str, timeout: float, where: str = "") -> Dict[str, Any]:
    """Ask job ``job_id`` to checkpoint now and wait (watch) for rank 0's answer.

    Raises ConfigError when the job has no keys, CheckpointError when it did not answer
    within ``timeout`` (the request is withdrawn) or answered with an error.
    """
    keys = JobKeys(job_id)
    rid = new_request_id()
    if store.get(keys.config) is None and not store.get_prefix(keys.prefix)[0]:
        raise ConfigError(f"no job {job_id!r} in etcd{where}: check --rdzv-id (see `elasticrun status`)")
    store.put_json(keys.checkpoint_request(rid), request_body(rid))
    try:
        kv = store.wait_for(keys.checkpoint_answer(rid), lambda kv: kv is not None, timeout)
    except TimeoutError:
        store.delete(keys.checkpoint_request(rid))
        raise CheckpointError(
            f"job {job_id!r} did not checkpoint within {timeout:g}s (request withdrawn): is it running and "
            "calling the elasticrun checkpoint hook? see `elasticrun status`"
        ) from None
    try:
        answer = kv.json() if kv is not None else {}
    except ValueError:
        raise CheckpointError(f"job {job_id!r} answered with something that is not JSON: {kv.value[:100]!r}") from None
    if not isinstance(answer, dict):
        raise CheckpointError(f"job {job_id!r} answered with an unexpected value: {answer!r}")
    if answer.get("error"):
        raise CheckpointError(f"job {job_id!r} could not checkpoint: {answer['error']}")
    return answer


__all__ = ["answer_done", "answer_error", "new_request_id", "parse_request", "request_body", "request_checkpoint"]
