"""Records read from etcd, checked at one boundary.

Anything under a job's prefix may be malformed: written by another version, a foreign client or
by hand (truncated JSON, a list where an object belongs, a string where a number does). No reader
trusts one. Each record type has a *check* (a function that takes the decoded JSON and returns the
value, or raises :class:`BadRecord` saying what is wrong), and every read goes through
:func:`parse` (or :func:`read` for a key/value as etcd returned it): the checked value, or ``None``
after the record was reported — once per key and problem, on the ``elasticrun.records`` logger
(stderr) — so a bad record is skipped or treated as absent and never ends an agent, a worker or a
command.

This module holds that machinery (:func:`decode`, :func:`report`, :func:`field`) and the checks of
the job-level records: ``config``, ``state``, the round flags (``rounds/<n>/failed``, ``end``,
``joining``, and the time marks ``done``, ``left``, ``ready``), failure rows, the restart history,
progress reports, goodput summaries and the expiry record. The rendezvous's own records (node
records, rounds, rescale events) are parsed in :mod:`elasticrun.rendezvous.records` with the same
functions; checkpoint requests and answers in :mod:`elasticrun.job.requests`.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from elasticrun.job.inplace import DURING_INPLACE

log = logging.getLogger("elasticrun.records")

T = TypeVar("T")
Check = Callable[[Any], T]

MAX_RECORD = 16 << 20  # bytes: a larger value is refused without decoding it
_REPORTED_MAX = 4096  # (key, problem) pairs remembered, so a bad record is reported once


class BadRecord(ValueError):
    """A record that does not have its type's shape; ``str()`` says what is wrong."""


# -- decoding and reporting ----------------------------------------------------------------------


def decode(value: Any) -> Any:
    """The JSON of an etcd value; BadRecord when it is not JSON (not UTF-8, truncated, too big,
    nested too deeply)."""
    try:
        if len(value) > MAX_RECORD:
            raise BadRecord(f"{len(value)} bytes, more than the {MAX_RECORD} a record may have")
        return json.loads(value)
    except RecursionError:
        raise BadRecord("JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8 text") from None
    except (ValueError, TypeError) as err:
        raise BadRecord(f"not JSON ({_clip(str(err), 80)})") from None


_lock = threading.Lock()
_reported: OrderedDict[Tuple[str, str], None] = OrderedDict()


def report(key: str, problem: str) -> bool:
    """Say once (per key and problem) that the record at ``key`` is ignored and why; True when said now."""
    entry = (key, problem)
    with _lock:
        if entry in _reported:
            return False
        _reported[entry] = None
        if len(_reported) > _REPORTED_MAX:
            _reported.popitem(last=False)
    log.warning("elasticrun: ignoring a malformed record in etcd at %s: %s", _clip(key, 200), _clip(problem, 300))
    return True


def parse(key: str, value: Any, check: Check[T]) -> Optional[T]:
    """``check(decode(value))``, or None after reporting the record at ``key`` (see :func:`report`)."""
    try:
        return check(decode(value))
    except BadRecord as err:
        report(key, str(err))
        return None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as err:
        report(key, f"{type(err).__name__}: {_clip(str(err), 120)}")  # a check that missed a case
        return None


def read(kv: Any, check: Check[T]) -> Optional[T]:
    """:func:`parse` of a key/value as etcd returned it (anything with ``key`` and ``value``); None when absent."""
    return None if kv is None else parse(kv.key, kv.value, check)


# -- field checks ----------------------------------------------------------------------------------

_REQUIRED: Any = object()


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(value: Any) -> str:
    return _clip(json.dumps(value, default=str), 60)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """An int or a finite float (not a bool)."""
    return is_int(x) or (isinstance(x, float) and math.isfinite(x))


def is_text(x: Any) -> bool:
    return isinstance(x, str)


def is_bool(x: Any) -> bool:
    return isinstance(x, bool)


def is_list(x: Any) -> bool:
    return isinstance(x, list)


def is_object(x: Any) -> bool:
    return isinstance(x, dict)


_KINDS: Dict[Callable[[Any], bool], str] = {
    is_int: "an integer",
    is_number: "a number",
    is_text: "a string",
    is_bool: "true or false",
    is_list: "a list",
    is_object: "a JSON object",
}


def kind_of(check: Callable[[Any], bool]) -> str:
    return _KINDS.get(check, getattr(check, "__doc__", None) or check.__name__)


def obj(value: Any) -> Dict[str, Any]:
    """``value`` when it is a JSON object; BadRecord otherwise."""
    if not isinstance(value, dict):
        raise BadRecord(f"expected a JSON object, got {_show(value)}")
    return value


def field(d: Dict[str, Any], name: str, check: Callable[[Any], bool], default: Any = _REQUIRED,
          nullable: bool = False) -> Any:
    """``d[name]`` when ``check`` accepts it (``None`` too with ``nullable``); ``default`` when absent
    (BadRecord when there is none, or the value has another type)."""
    if name not in d:
        if default is _REQUIRED:
            raise BadRecord(f"field {name!r} is missing")
        return default
    value = d[name]
    if value is None and nullable:
        return None
    if not check(value):
        raise BadRecord(f"field {name!r}: expected {kind_of(check)}, got {_show(value)}")
    return value


def items(value: Any, name: str, check: Callable[[Any], bool]) -> List[Any]:
    """``value`` when it is a list whose every item ``check`` accepts."""
    if not isinstance(value, list):
        raise BadRecord(f"field {name!r}: expected a list, got {_show(value)}")
    for i, item in enumerate(value):
        if not check(item):
            raise BadRecord(f"field {name!r}[{i}]: expected {kind_of(check)}, got {_show(item)}")
    return value


# -- the job-level records -----------------------------------------------------------------------------


def config_record(value: Any) -> Dict[str, Any]:
    """``config``: the settings every node must share (any JSON object; compared as a whole)."""
    return obj(value)


class JobState(str, enum.Enum):
    """A job's terminal state (the ``state`` record's ``state`` field)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # its last node left before an outcome (a signal, or it gave up waiting for nodes)


_JOB_STATES = frozenset(s.value for s in JobState)


def state_record(value: Any) -> Dict[str, Any]:
    """``state``: ``{state, reason, round, time[, exit_code]}`` — the job's end (``state`` one of
    :class:`JobState`: a value this version does not know ends nothing)."""
    d = obj(value)
    if field(d, "state", is_text) not in _JOB_STATES:
        raise BadRecord(f"field 'state': {_show(d['state'])} is none of {', '.join(sorted(_JOB_STATES))}")
    field(d, "reason", is_text, default="")
    field(d, "round", is_int, default=-1)
    field(d, "time", is_number, default=0.0)
    field(d, "exit_code", is_int, default=None, nullable=True)
    return d


def failed_flag(value: Any) -> Dict[str, Any]:
    """``rounds/<n>/failed``: ``{node, rank, time}`` — the round's first worker failure."""
    d = obj(value)
    field(d, "node", is_text)
    field(d, "rank", is_int, default=None, nullable=True)
    field(d, "time", is_number, default=None, nullable=True)
    return d


def end_flag(value: Any) -> Dict[str, Any]:
    """``rounds/<n>/end``: ``{reason, by[, lost, time]}`` — the round ends for a membership change."""
    d = obj(value)
    field(d, "reason", is_text, default="round ended")
    field(d, "by", is_text, default="")
    field(d, "lost", is_text, default=None, nullable=True)
    field(d, "time", is_number, default=None, nullable=True)
    return d


def time_mark(value: Any) -> Dict[str, Any]:
    """``rounds/<n>/done|left|ready/<node>``: ``{time}`` (only the key's presence counts)."""
    d = obj(value)
    field(d, "time", is_number, default=None, nullable=True)
    return d


def joining_flag(value: Any) -> Dict[str, Any]:
    """``rounds/<n>/joining``: ``{nodes}`` — the newcomers the leader saw."""
    d = obj(value)
    items(field(d, "nodes", is_list, default=[]), "nodes", is_text)
    return d


_FAILURE_FIELDS: Tuple[Tuple[str, Callable[[Any], bool]], ...] = (
    ("node_id", is_text), ("host", is_text), ("rank", is_int), ("local_rank", is_int), ("exitcode", is_int),
    ("signal", is_text), ("message", is_text), ("traceback", is_text), ("timestamp", is_number),
    ("stderr_tail", is_text), (DURING_INPLACE, is_bool),
)


def failure_rows(value: Any) -> List[Dict[str, Any]]:
    """``rounds/<n>/failures/<node>``: that node's failed workers (a list of objects; every known field
    absent, null or of its type)."""
    if not isinstance(value, list):
        raise BadRecord(f"expected a list of failed workers, got {_show(value)}")
    for i, row in enumerate(value):
        if not isinstance(row, dict):
            raise BadRecord(f"item {i}: expected a JSON object, got {_show(row)}")
        for name, check in _FAILURE_FIELDS:
            try:
                field(row, name, check, default=None, nullable=True)
            except BadRecord as err:
                raise BadRecord(f"item {i}: {err}") from None
    return value


def restart_history(value: Any) -> List[float]:
    """``restarts``: ``{times}`` — the times of the restarts counted against ``--max-restarts``."""
    d = obj(value)
    return [float(t) for t in items(field(d, "times", is_list, default=[]), "times",
                                     is_number)]


def _stall(x: Any) -> bool:
    """a [count, total seconds, last seconds] list"""
    return isinstance(x, list) and len(x) == 3 and all(is_number(v) for v in x)


def progress_record(value: Any) -> Dict[str, Any]:
    """``progress/<node>``: ``{step, loss, samples_per_s, rank, round, world_size, time[, stalls, closed]}``."""
    d = obj(value)
    field(d, "step", is_int)
    for name in ("loss", "samples_per_s", "time"):
        field(d, name, is_number, default=None, nullable=True)
    for name in ("rank", "round", "world_size"):
        field(d, name, is_int, default=None, nullable=True)
    field(d, "closed", is_bool, default=False)
    field(d, "compute", _seconds_by_name, default={})
    stalls = field(d, "stalls", is_object, default={})
    for kind, entry in stalls.items():
        if not _stall(entry):
            raise BadRecord(f"field 'stalls'[{kind!r}]: expected {kind_of(_stall)}, got {_show(entry)}")
    return d


def _seconds_by_name(x: Any) -> bool:
    """an object of numbers"""
    return isinstance(x, dict) and all(is_number(v) for v in x.values())


def goodput_record(value: Any) -> Dict[str, Any]:
    """``goodput/<node>``: an agent's goodput summary (every number a number, the per-cause and
    per-phase seconds objects of numbers; fields this version does not know pass unchecked)."""
    d = obj(value)
    for name in ("wall_s", "goodput_s", "goodput_ratio", "time"):
        field(d, name, is_number, default=None, nullable=True)
    for name in ("steps_lost", "step"):
        field(d, name, is_int, default=None, nullable=True)
    for name in ("badput_s", "phase_s"):
        field(d, name, _seconds_by_name, default=None, nullable=True)
    return d


def straggler_record(value: Any) -> Dict[str, Any]:
    """``health/stragglers``: ``{round, time, threshold, window_s, median_s, ranks: {rank: {node, compute_s,
    ratio, straggler, slow_since}}, nodes: {node: worst ratio}, drain: [node]}``."""
    d = obj(value)
    field(d, "round", is_int)
    for name in ("time", "threshold", "window_s"):
        field(d, name, is_number, default=0.0)
    field(d, "median_s", is_number, default=None, nullable=True)
    ranks = field(d, "ranks", is_object, default={})
    for rank, row in ranks.items():
        if not (isinstance(row, dict) and is_text(row.get("node")) and is_number(row.get("ratio"))
                and is_bool(row.get("straggler", False))):
            raise BadRecord(f"field 'ranks'[{rank!r}]: expected an object with node, ratio, straggler")
    field(d, "nodes", _seconds_by_name, default={})
    drain = field(d, "drain", is_list, default=[])
    if not all(is_text(n) for n in drain):
        raise BadRecord("field 'drain': expected a list of node ids")
    return d


def excluded_record(value: Any) -> Dict[str, Any]:
    """``health/excluded/<node>``: ``{reason, why ("node-check"|"straggler"), time[, checks]}``."""
    d = obj(value)
    field(d, "reason", is_text)
    field(d, "why", is_text, default="node-check")
    field(d, "time", is_number, default=0.0)
    field(d, "checks", is_list, default=[])
    return d


def expiry_record(value: Any) -> Dict[str, Any]:
    """``expiry``: ``{lease, ttl, time}`` — the lease an ended job's keys were put on."""
    d = obj(value)
    field(d, "lease", is_int)
    field(d, "ttl", is_number, default=0.0)
    field(d, "time", is_number, default=0.0)
    return d


__all__ = [
    "BadRecord", "JobState", "MAX_RECORD", "config_record", "decode", "end_flag", "excluded_record", "expiry_record",
    "failed_flag",
    "failure_rows", "field", "goodput_record", "is_bool", "is_int", "is_list", "is_number", "is_object", "is_text",
    "items", "joining_flag", "obj",
    "parse", "progress_record", "read", "report", "restart_history", "state_record", "straggler_record", "time_mark",
]
