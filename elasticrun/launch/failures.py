"""Worker failures: what went wrong where, from exit codes, error files and stderr.

``torch.distributed.elastic.multiprocessing.errors.record`` writes
``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``
into the file named by ``TORCHELASTIC_ERROR_FILE``; we read it back for the root cause.
A worker without ``@record`` leaves no file: its exception line and the last lines of its
stderr tell instead. Everything here is bounded (:data:`MESSAGE_MAX`, :data:`TRACEBACK_MAX`,
:data:`TAIL_LINES`/:data:`TAIL_MAX`, :data:`REPORT_MAX` for all of a node's failures
together), because failures travel through etcd, whose requests are limited to ~1.5 MiB.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from rich.table import Table
from rich.text import Text

MESSAGE_MAX = 2048  # bytes of an error message kept
TRACEBACK_MAX = 16 * 1024  # bytes of a traceback kept (its end: where it was raised)
TAIL_LINES = 20  # lines of stderr kept
TAIL_MAX = 4096  # bytes of stderr kept
REPORT_MAX = 64 * 1024  # all of one node's failures of one round, as JSON
ERROR_FILE_READ_MAX = 8 * 1024 * 1024  # a bigger error file is not parsed (only its size is reported)
_TRACEBACK_HEAD = "Traceback (most recent call last):"


@dataclass
class WorkerFailure:
    """One failed worker."""

    node_id: str
    host: str
    rank: int
    local_rank: int
    exitcode: int
    signal: Optional[str]
    message: str
    traceback: str
    timestamp: float
    stderr_tail: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def signal_name(exitcode: int) -> Optional[str]:
    """``-9`` → ``SIGKILL``; None for ordinary exit codes."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def clip_head(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, keeping its beginning."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: max(0, limit - 20)].decode("utf-8", "ignore") + " ... (truncated)"


def clip_tail(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, keeping its end."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return "(truncated) ...\n" + raw[-max(0, limit - 20):].decode("utf-8", "ignore")


def read_error_file(path: str) -> Tuple[str, str, Optional[float]]:
    """(message, traceback, timestamp) from a torchelastic error file; empty when absent or unreadable.

    The message and traceback come back bounded (:data:`MESSAGE_MAX`, :data:`TRACEBACK_MAX`).
    """
    try:
        size = os.path.getsize(path)
        if size > ERROR_FILE_READ_MAX:
            return f"error file {path} is too large to read ({size} bytes)", "", None
        with open(path, errors="replace") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return "", "", None
    msg = data.get("message", data) if isinstance(data, dict) else data
    if not isinstance(msg, dict):
        return clip_head(str(msg), MESSAGE_MAX), "", None
    text = str(msg.get("message", ""))
    extra = msg.get("extraInfo", {}) or {}
    stamp = extra.get("timestamp") if isinstance(extra, dict) else None
    try:
        ts = float(stamp) if stamp is not None else None
    except (TypeError, ValueError):
        ts = None
    tb = str(extra.get("py_callstack", "")) if isinstance(extra, dict) else ""
    return clip_head(text, MESSAGE_MAX), clip_tail(tb, TRACEBACK_MAX), ts


def stderr_tail(data: bytes, lines: int = TAIL_LINES, limit: int = TAIL_MAX) -> str:
    """The last ``lines`` lines of a worker's stderr, at most ``limit`` bytes (``\\r`` redraws dropped)."""
    text = data.decode("utf-8", "replace")
    rows = [ln.rsplit("\r", 1)[-1].rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while rows and not rows[-1]:
        rows.pop()
    return clip_tail("\n".join(rows[-lines:]), limit)


def exception_line(text: str) -> str:
    """The ``Type: message`` line of the last Python traceback in ``text``, or ''."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip() == _TRACEBACK_HEAD]
    if not starts:
        return ""
    for ln in lines[starts[-1] + 1:]:
        if ln.strip() and not ln[0].isspace() and not ln.startswith(("+", "|")):
            return ln.strip()
    return ""


def make_failure(
    node_id: str, host: str, rank: int, local_rank: int, exitcode: int, error_file: str, stderr: bytes = b""
) -> WorkerFailure:
    """The failure of one worker: its error file's message, else its exception line from stderr."""
    message, tb, ts = read_error_file(error_file)
    tail = stderr_tail(stderr) if stderr else ""
    sig = signal_name(exitcode)
    if not message:
        how = f"exited with signal {sig}" if sig else f"exited with code {exitcode}"
        exc = exception_line(stderr.decode("utf-8", "replace")) if stderr else ""
        message = clip_head(f"{exc} ({how})" if exc else how, MESSAGE_MAX)
    return WorkerFailure(node_id, host, rank, local_rank, exitcode, sig, message, tb, ts or time.time(), tail)


def _size(failure: WorkerFailure) -> int:
    return len(json.dumps(failure.to_dict())) + 2  # + the list's ", "


def bounded(failures: List[WorkerFailure], limit: int = REPORT_MAX) -> List[WorkerFailure]:
    """``failures`` (first = root cause) made to fit ``limit`` bytes of JSON for etcd.

    The first keeps the most; later ones lose their traceback, then their stderr tail, then
    are dropped (the last one kept says how many more failed).
    """
    out = list(failures)
    sizes = [_size(f) for f in out]

    def cut(i: int, **fields: str) -> bool:
        out[i] = replace(out[i], **fields)
        sizes[i] = _size(out[i])
        return sum(sizes) <= limit

    if sum(sizes) <= limit:
        return out
    for field in ("traceback", "stderr_tail"):
        for i in range(len(out) - 1, 0, -1):
            if getattr(out[i], field) and cut(i, **{field: ""}):
                return out
    for field, keep in (("traceback", 4096), ("stderr_tail", 2048), ("message", 1024)):
        clip = clip_head if field == "message" else clip_tail
        if cut(0, **{field: clip(getattr(out[0], field), keep)}):
            return out
    while len(out) > 1 and sum(sizes) > limit - 128:  # room for the note below
        out.pop()
        sizes.pop()
    dropped = len(failures) - len(out)
    if dropped:
        cut(len(out) - 1, message=clip_head(out[-1].message, 512) + f" (and {dropped} more failed workers)")
    return out


class HangRole(str, enum.Enum):
    """What a worker was doing when its round was stopped for a hang (the ``signal`` of its row)."""

    STOPPED = "hung"  # not in a collective (its own code, I/O, a lock, ...) or no stack came
    WAITING = "waiting"  # blocked in a torch.distributed collective, for the others


#: How a waiting row's message names the collective: ``... waiting in all_reduce``.
WAITING_IN = "waiting in "


def is_hang_row(row: Dict[str, Any]) -> bool:
    """Whether a failure row was written for a hang (``--hang-timeout``), on any node."""
    return row.get("signal") in {h.value for h in HangRole}


@dataclass
class HangVerdict:
    """Which ranks' progress stopped first, from every node's hang rows (:func:`hang_verdict`)."""

    rows: List[Dict[str, Any]]  # the rows in blame order: ranks that stopped first, then those waiting
    first: List[Dict[str, Any]]  # the rows of the ranks that stopped first (empty: none can be told)
    note: str  # one sentence for the summary


def _ranks(rows: List[Dict[str, Any]]) -> str:
    ranks = sorted({str(r.get("rank")) for r in rows}, key=lambda x: (len(x), x))
    shown = ", ".join(ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def hang_verdict(rows: List[Dict[str, Any]]) -> Optional[HangVerdict]:
    """Name the ranks whose progress stopped first in a hung round, or say that none can be told.

    A rank blocked in a collective waits for the others; a rank that stands anywhere else while
    some wait stopped first. When every rank waits (mismatched collectives, a dead peer) or none
    does (each stuck on its own), the stacks cannot tell. None when ``rows`` hold no hang."""
    hang = [r for r in rows if is_hang_row(r)]
    if not hang:
        return None
    stopped = [r for r in hang if r.get("signal") == HangRole.STOPPED.value]
    waiting = [r for r in hang if r.get("signal") == HangRole.WAITING.value]
    others = [r for r in rows if r not in hang]
    if stopped and waiting:
        where = sorted({str(r.get("message", "")).rsplit(WAITING_IN, 1)[-1] for r in waiting})
        note = (f"{_ranks(stopped)} stopped first: not in a collective while {_ranks(waiting)} "
                f"{'waits' if len(waiting) == 1 else 'wait'} in {', '.join(where)}")
        return HangVerdict(stopped + waiting + others, stopped, note)
    why = "every rank waits in a collective" if waiting else "no rank waits in a collective"
    return HangVerdict(hang + others, [], f"which rank stopped first cannot be told ({why})")


def root_cause_table(rows: List[Dict[str, Any]], title: str) -> Table:
    """A rich table of failures, the first (root cause) on top with its traceback's or stderr's tail.

    For a hang, the ranks that stopped first come first (:func:`hang_verdict`), marked
    "(stopped first)", and the first row says which ranks stopped first or that none can be told.
    Every cell is a :class:`rich.text.Text`: worker text (``[rank1]:``, gloo's ``[/path/x.cc:78]``)
    is shown verbatim, never read as markup.
    """
    verdict = hang_verdict(rows)
    if verdict is not None:
        rows = verdict.rows
    table = Table(title=Text(title, style="bold red"), show_lines=True)
    table.add_column("node", overflow="fold", no_wrap=False, min_width=8)
    table.add_column("rank", overflow="fold", min_width=6)
    table.add_column("exit", overflow="fold", min_width=4)
    table.add_column("error", overflow="fold", min_width=30)
    for i, r in enumerate(rows):
        exit_text = r.get("signal") or str(r.get("exitcode"))
        error = str(r.get("message", ""))
        tb = (r.get("traceback") or "").strip()
        tail = (r.get("stderr_tail") or "").strip()
        if i == 0 and verdict is not None:
            error += f"\n{verdict.note}"
            if tail:
                error += "\n--- its stack (elasticrun's own frames left out):\n" + tail
        elif i == 0 and tb:
            error += "\n" + "\n".join(tb.splitlines()[-12:])
        elif i == 0 and tail:
            error += "\n--- last lines of its stderr:\n" + tail
        if verdict is None:
            label = " (root cause)" if i == 0 else ""
        else:
            label = " (stopped first)" if r in verdict.first else ""
        table.add_row(Text(f"{r.get('node_id')}{label}"), Text(f"{r.get('rank')} (local {r.get('local_rank')})"),
                      Text(exit_text), Text(error))
    return table
