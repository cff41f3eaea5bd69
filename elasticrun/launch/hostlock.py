"""The per-machine lock on a hosted etcd's ``ip:port``: of one user's agents here, only its holder hosts.

Without it two agents on one machine could both start etcd on the port, and the loser's
health check would be answered by the winner's server.

The lock file lives in a directory only its user can enter: ``$XDG_RUNTIME_DIR`` when it is
ours and private, else ``<tmp>/elasticrun-<uid>`` created 0700 (a directory by that name that
is not ours, not a directory, or open to others is never used). So no other local user can
hold, replace or link the file and keep us from hosting. The file is created 0600 without
following links, locked with ``flock`` (the kernel drops it when its holder dies: a lock of a
dead process never blocks), and removed by its holder at release. When no private directory
can be had the lock is skipped: the port check alone then decides, as it always did.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from typing import Optional


def private_dir(runtime: bool = True) -> Optional[str]:
    """A directory only this user can use (created if needed), or None. ``runtime=False``: never
    ``$XDG_RUNTIME_DIR`` (a small tmpfs), for data that may grow."""
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR") if runtime else None
    candidates = [xdg] if xdg else []
    candidates.append(os.path.join(tempfile.gettempdir(), f"elasticrun-{uid}"))
    for path in candidates:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
            return path
    return None


class HostLock:
    """The lock on ``ip:port`` (see the module doc); :meth:`acquire`, then :meth:`release` at exit."""

    def __init__(self, ip: str, port: int, directory: Optional[str] = None) -> None:
        base = directory or private_dir()
        self.path: Optional[str] = None if base is None else os.path.join(base, f"etcd-{ip}-{port}.lock")
        self.fd: Optional[int] = None

    def acquire(self) -> bool:
        """True when we hold the lock now (or no private directory exists: the port check decides)."""
        if self.path is None:
            return True
        for _ in range(5):  # the file may be removed between our open and our lock: open it again
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError:
                return True  # unusable: fall back to the port check alone
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False  # a live agent of ours holds it
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except OSError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)  # we locked a file its holder removed meanwhile
        return True

    def release(self) -> None:
        """Remove the file (while still holding it) and unlock."""
        if self.fd is None:
            return
        try:
            if self.path is not None:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


__all__ = ["HostLock", "private_dir"]
