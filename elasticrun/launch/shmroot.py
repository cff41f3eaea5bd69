"""The node's shared-memory root: the directory the agent owns and its workers snapshot into.

The agent creates its root in ``/dev/shm`` (mode 0700; the name and the layout inside:
:mod:`elasticrun.job.shm`) when it starts and names it to its workers in
``ELASTICRUN_SNAPSHOT_DIR``. Workers come and go (a crash, a restart, a rescale); the
directory — and the snapshots in it — stay until the agent exits. It is removed

- by the agent itself when it exits normally (:meth:`SnapshotRoot.remove`);
- by a watchdog after the agent dies in any way, SIGKILL included: a tiny interpreter
  started in its own session (``subprocess.Popen``, never ``fork`` from the agent's gRPC
  process) that blocks reading a pipe whose write end only the agent holds; when the
  agent dies the kernel closes the pipe, the read returns, and the watchdog removes the
  directory;
- by the next agent on the machine, as a last resort (:func:`sweep`): a directory is removed
  at start only when it belongs to this user, is a real directory (not a link) and its
  ``lock`` file can be flocked without blocking: the owning agent holds that lock for its
  lifetime (the file appears under that name already locked, so a sweep never finds a new
  root's lock free), so liveness is decided by the kernel, not by a pid (which means nothing to an
  agent in another pid namespace sharing ``/dev/shm``). The sweep opens nothing but that
  lock, with ``O_NOFOLLOW|O_NONBLOCK``, and only when it is a regular file: it never blocks
  on a FIFO nor reads a device.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Callable, List, Optional

from elasticrun.job.shm import LOCK_FILE, OWNER_FILE, SHM_DIR, parse_root_name, root_name

# The watchdog: no imports beyond the standard library, no site packages (fast, nothing to fail).
_WATCHDOG = (
    "import os, shutil, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(s, signal.SIG_IGN)\n"
    "try:\n"
    "    while sys.stdin.buffer.read(4096):\n"
    "        pass\n"
    "finally:\n"
    "    shutil.rmtree(sys.argv[1], ignore_errors=True)\n"
)


def _start_time(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid`` (field 22 of /proc/<pid>/stat), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _open_lock(path: str, create: bool = False) -> Optional[int]:
    """An fd on the regular file ``path`` (never a FIFO, device or link: no blocking, no reads)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def create_owner_lock(path: str) -> int:
    """Create the lock file of the directory ``path`` an agent owns (a snapshot root, an etcd member's
    home: launch/etcdhome.py) already locked: it is made and flocked under a private name, then renamed
    to :data:`LOCK_FILE` (the flock belongs to the open file, which the rename keeps). A concurrent
    sweep sees either no lock (it keeps the directory) or a held one — never a lock it could take
    between its creation and our flock, which would remove a live directory. Keep the fd open."""
    private = os.path.join(path, f".{LOCK_FILE}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = _open_lock(private, create=True)
    if fd is None:
        raise OSError(f"cannot create {LOCK_FILE}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process exits
        os.rename(private, os.path.join(path, LOCK_FILE))
    except OSError:
        os.close(fd)
        raise
    return fd


def owner_gone(path: str) -> bool:
    """Whether the owned directory ``path`` is ours to remove: our uid, a real directory, its lock free."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    fd = _open_lock(os.path.join(path, LOCK_FILE))
    if fd is None:
        return False  # no lock (an agent still creating it, or not a root we understand): keep it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its agent holds the lock: alive, whatever pid namespace it runs in
    finally:
        os.close(fd)
    return True


def _is_root_name(entry: str) -> bool:
    return parse_root_name(entry) is not None


def sweep(base: str = SHM_DIR, named: Callable[[str], object] = _is_root_name) -> List[str]:
    """Remove the owned directories in ``base`` whose name ``named`` accepts (default: snapshot roots) and
    whose owning agent is gone; returns their paths."""
    removed: List[str] = []
    try:
        entries = os.listdir(base)
    except OSError:
        return removed
    for entry in entries:
        if not named(entry):
            continue
        path = os.path.join(base, entry)
        if owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return removed


@dataclass
class SnapshotRoot:
    """An agent's shared-memory directory and the watchdog that removes it if the agent dies."""

    path: str
    watchdog: Optional[subprocess.Popen] = None
    lock_fd: Optional[int] = None

    @classmethod
    def create(cls, job_id: str, node_id: str, base: str = SHM_DIR,
               say: Callable[[str], None] = lambda _m: None) -> Optional[SnapshotRoot]:
        """Sweep dead agents' roots, make ours (0700) and start its watchdog; None when ``base`` is
        not usable (no /dev/shm: workers then get no memory tier and snapshots say so)."""
        if not os.path.isdir(base) or not os.access(base, os.W_OK | os.X_OK):
            return None
        for path in sweep(base):
            say(f"removed the memory snapshots of a dead agent: {path}")
        pid = os.getpid()
        path = os.path.join(base, root_name(job_id, node_id, pid))
        try:
            shutil.rmtree(path, ignore_errors=True)  # a leftover of an agent with our pid in this process
            os.mkdir(path, 0o700)
            lock_fd = create_owner_lock(path)
            with open(os.path.join(path, OWNER_FILE), "w", encoding="utf-8") as f:
                f.write(f"{pid} {_start_time(pid) or ''}\n")
        except OSError as err:
            say(f"no memory snapshots on this node: cannot create {path} ({err.strerror or err})")
            return None
        root = cls(path, lock_fd=lock_fd)
        root.watchdog = subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHDOG, path], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )
        return root

    def remove(self) -> None:
        """Remove the directory now and let the watchdog exit."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
        if self.watchdog is not None:
            if self.watchdog.stdin is not None:
                try:
                    self.watchdog.stdin.close()  # EOF: the watchdog removes (what is left of) the path and exits
                except OSError:
                    pass
            try:
                self.watchdog.wait(5.0)
            except subprocess.TimeoutExpired:
                self.watchdog.kill()
                self.watchdog.wait()
            self.watchdog = None


__all__ = ["SnapshotRoot", "create_owner_lock", "owner_gone", "sweep"]
