"""The checkpoint-request protocol between ``elasticrun ckpt save --rdzv-id`` and rank 0.

Keys (see :mod:`elasticrun.job.keys`)::

    control/checkpoint/<request_id>       = {"request_id": ..., "requested_at": ...}   written by the CLI
    control/checkpoint-done/<request_id>  = {"name": ..., "root": ..., "step": ...}     written by rank 0
                                          | {"error": "..."}

A request without an answer is pending. Nothing stays behind: rank 0 deletes a request
when it answers and puts its answer on a lease (:data:`ANSWER_TTL_S`); the CLI deletes the
request and the answer once it has read it, and withdraws a request it stops waiting for.
A job that has ended (its ``state``) or has no running node is told at once. This module holds the
names and formats; the CLI's side (asking, waiting) is :mod:`elasticrun.cli.ckpt_request`, rank 0's
(watching, agreeing across ranks) :class:`elasticrun.train.control.CheckpointRequests`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, Optional, Tuple

from elasticrun.job import records
from elasticrun.job.keys import last_part

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


def why_gone(job_id: str, state: Optional[Dict[str, Any]], running_nodes: int) -> Optional[str]:
    """Why job ``job_id`` cannot answer a request any more (it ended: its ``state`` record; or no agent
    runs it), or None."""
    if state is not None:
        return describe_end(job_id, state)
    if not running_nodes:
        return f"job {job_id!r} has no running node (its agents stopped or were lost)"
    return None


__all__ = ["ANSWER_TTL_S", "answer_done", "answer_error", "answer_record", "describe_end", "new_request_id",
           "parse_request", "request_body", "request_record", "utc", "why_gone"]
