"""The agent's event log (``--events-file PATH``): one JSON object per line, for offline analysis.

Each line: ``{"time": <unix s>, "event": <EventKind>, "job": ..., "node": ..., ...details}``.
Appended and flushed per event (a crash loses nothing written before it); several agents on
one host may share a file: each line is one ``write`` of less than a pipe buffer.
"""

from __future__ import annotations

import enum
import json
import os
import threading
import time
from typing import Any, Optional

from elasticrun.errors import ConfigError


class EventKind(str, enum.Enum):
    """What happened."""

    ROUND_FORMED = "round_formed"
    RESCALE = "rescale"
    RESTART = "restart"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    HANG = "hang"
    OUTAGE_BEGIN = "outage_begin"
    OUTAGE_END = "outage_end"
    JOB_ENDED = "job_ended"


class EventLog:
    """Appends events to a JSON-lines file; a no-op without a path."""

    def __init__(self, path: Optional[str], job_id: str, node_id: str) -> None:
        self.path = path
        self.job_id = job_id
        self.node_id = node_id
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        if path:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as err:
                raise ConfigError(f"--events-file {path!r}: cannot open for appending ({err.strerror}); "
                                  "give a writable path") from None

    def emit(self, kind: EventKind, **details: Any) -> None:
        """Append one event (never raises: a full disk must not stop training)."""
        if self._fd is None:
            return
        record = {"time": round(time.time(), 3), "event": kind.value, "job": self.job_id, "node": self.node_id}
        record.update(details)
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            try:
                os.write(self._fd, line)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


__all__ = ["EventKind", "EventLog"]
