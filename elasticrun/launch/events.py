"""The agent's event log (``--events-file PATH``): one JSON object per line, for offline analysis.

Each line: ``{"time": <unix s>, "event": <EventKind>, "job": ..., "node": ..., ...details}``.
Appended and flushed per event (a crash loses nothing written before it); several agents on
one host may share a file: each line is one ``write`` of less than a pipe buffer.

The events carry the job's command line, and the path may lie in a shared directory: the file is
created 0600, opened without following a symbolic link at its last component, and refused when it
is not a regular file or belongs to another user (:func:`open_private_append`).
"""

from __future__ import annotations

import enum
import errno
import json
import os
import stat
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
    NODE_CHECK = "node_check"  # --node-check ran: passed, or why not
    STRAGGLER = "straggler"  # this node became (or stopped being) a straggler
    DRAINED = "drained"  # this node leaves the job as a straggler (--straggler-action drain)


def open_private_append(path: str, flag: str) -> int:
    """A descriptor appending to ``path``, created 0600 if absent. ConfigError (one line, naming
    ``flag``) when it cannot be opened, is a symbolic link, is not a regular file, or belongs to
    another user; the file's data is never touched on refusal."""
    how = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, how, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(f"{flag} {path!r} is a symbolic link (not followed: one planted in a shared "
                              "directory would redirect the file); give the file's own path") from None
        raise ConfigError(f"{flag} {path!r}: cannot open for appending ({err.strerror}); "
                          "give a writable path") from None
    st = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
               else f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.geteuid() else "")
    if problem:
        os.close(fd)
        raise ConfigError(f"{flag} {path!r} {problem}; give a file of your own (one is created 0600)")
    os.set_blocking(fd, True)
    return fd


class EventLog:
    """Appends events to a JSON-lines file; a no-op without a path."""

    def __init__(self, path: Optional[str], job_id: str, node_id: str) -> None:
        self.path = path
        self.job_id = job_id
        self.node_id = node_id
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        if path:
            self._fd = open_private_append(path, "--events-file")

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


__all__ = ["EventKind", "EventLog", "open_private_append"]
