"""The checkpoint-request protocol between ``elasticrun ckpt save --rdzv-id`` and rank 0.

Keys (see :mod:`elasticrun.job.keys`)::

    control/checkpoint/<request_id>       = {"request_id": ..., "requested_at": ...}   written by the CLI
    control/checkpoint-done/<request_id>  = {"name": ..., "root": ..., "step": ...}     written by rank 0
                                          | {"error": "..."}

A request without an answer is pending. Nothing stays behind: rank 0 deletes a request
when it answers and puts its answer on a lease (:data:`ANSWER_TTL_S`); the CLI deletes the
request and the answer once it has read it, and withdraws a request it stops waiting for.
A job that has ended (its ``state``) or has no running node is told at once. Rank 0's side
(watching, agreeing across ranks) is :class:`elasticrun.train.control.CheckpointRequests`.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from elasticrun.errors import CheckpointError, ConfigError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys, last_part

if TYPE_CHECKING:
    from elasticrun.store.client import EtcdStore
    from elasticrun.store.types import KeyValue

#: Seconds rank 0's answer lives (on a lease): its asker reads and deletes it at once.
ANSWER_TTL_S = 600


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


def request_record(value: Any) -> Dict[str, Any]:
    """``control/checkpoint/<id>``: ``{request_id, requested_at}``."""
    d = records.obj(value)
    records.field(d, "request_id", records.is_text, default="")
    records.field(d, "requested_at", records.is_number, default=None, nullable=True)
    return d


def answer_record(value: Any) -> Dict[str, Any]:
    """``control/checkpoint-done/<id>``: ``{name, root, step}`` or ``{error}``."""
    d = records.obj(value)
    if "error" in d:
        records.field(d, "error", records.is_text)
        return d
    records.field(d, "name", records.is_text)
    records.field(d, "root", records.is_text)
    records.field(d, "step", records.is_int)
    return d


def parse_request(key: str, value: bytes) -> Tuple[str, float]:
    """(request id, requested_at) of a request key; a malformed body (reported once) still counts as a
    request: the key names it, and answering it costs one checkpoint."""
    rid = last_part(key)  # the key names the request; the answer goes to the same id
    body = records.parse(key, value, request_record) or {}
    at = body.get("requested_at")
    return rid, float(at) if at is not None else time.time()


def utc(t: float) -> str:
    """A wall-clock time as shown in messages: ``2026-11-26 19:20:01 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe_end(job_id: str, state: Dict[str, Any]) -> str:
    """``job 'x' finished at <time> (failed: <reason>)`` from the job's ``state`` record."""
    at = state.get("time")
    when = f" at {utc(float(at))}" if isinstance(at, (int, float)) else ""
    outcome = str(state.get("state", "ended"))
    reason = state.get("reason")
    return f"job {job_id!r} finished{when} ({outcome}{': ' + str(reason) if reason else ''})"


def _job_gone(store: EtcdStore, keys: JobKeys) -> Optional[str]:
    """Why job ``keys`` cannot answer a request any more (it ended, or no agent runs it), or None."""
    state = records.read(store.get(keys.state), records.state_record)  # a malformed one counts as absent
    if state is not None:
        return describe_end(keys.job_id, state)
    if not store.get_prefix(keys.nodes)[0]:
        return f"job {keys.job_id!r} has no running node (its agents stopped or were lost)"
    return None


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


__all__ = ["ANSWER_TTL_S", "answer_done", "answer_error", "answer_record", "describe_end", "new_request_id",
           "parse_request", "request_body", "request_checkpoint", "request_record", "utc"]
