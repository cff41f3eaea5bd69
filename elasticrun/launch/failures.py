"""Worker failures: what went wrong where, from exit codes and TORCHELASTIC_ERROR_FILE.

``torch.distributed.elastic.multiprocessing.errors.record`` writes
``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``
into the file named by ``TORCHELASTIC_ERROR_FILE``; we read it back for the root cause.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

from rich.table import Table


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


def read_error_file(path: str) -> Tuple[str, str, Optional[float]]:
    """(message, traceback, timestamp) from a torchelastic error file; empty when absent or unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return "", "", None
    msg = data.get("message", data)
    if isinstance(msg, str):
        return msg, "", None
    text = str(msg.get("message", ""))
    extra = msg.get("extraInfo", {}) or {}
    stamp = extra.get("timestamp")
    try:
        ts = float(stamp) if stamp is not None else None
    except (TypeError, ValueError):
        ts = None
    return text, str(extra.get("py_callstack", "")), ts


def make_failure(node_id: str, host: str, rank: int, local_rank: int, exitcode: int, error_file: str) -> WorkerFailure:
    message, tb, ts = read_error_file(error_file)
    sig = signal_name(exitcode)
    if not message:
        message = f"exited with signal {sig}" if sig else f"exited with code {exitcode}"
        message += " (no error file: decorate main with torch.distributed.elastic.multiprocessing.errors.record)"
    return WorkerFailure(node_id, host, rank, local_rank, exitcode, sig, message, tb, ts or time.time())


def root_cause_table(rows: List[Dict[str, Any]], title: str) -> Table:
    """A rich table of failures, the first (root cause) on top with its traceback's tail."""
    table = Table(title=title, title_style="bold red", show_lines=True)
    for col in ("node", "rank", "exit", "error"):
        table.add_column(col, overflow="fold")
    for i, r in enumerate(rows):
        exit_text = r.get("signal") or str(r.get("exitcode"))
        error = r.get("message", "")
        tb = (r.get("traceback") or "").strip()
        if tb and i == 0:
            error += "\n" + "\n".join(tb.splitlines()[-12:])
        label = f"{r.get('node_id')}" + (" (root cause)" if i == 0 else "")
        table.add_row(label, f"{r.get('rank')} (local {r.get('local_rank')})", exit_text, error)
    return table
