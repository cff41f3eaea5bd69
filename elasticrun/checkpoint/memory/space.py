"""The memory tier's space rule: how much shared memory snapshots (and restores) may take.

``--snapshot-memory SIZE`` (``ELASTICRUN_SNAPSHOT_MEMORY``) sets the cap. Without it the
default cap is **half of the shared-memory filesystem's size, and at most half of the
container's memory limit** when one is set (cgroup v2 ``memory.max``, v1
``memory.limit_in_bytes``): files in ``/dev/shm`` are memory charged to the container, so
snapshots that filled it would leave NCCL's shared-memory transport and DataLoader workers
to die with SIGBUS, or get the pod OOM-killed. What counts against the cap: every file in
the node's snapshot directory (generations, replicas, transient copies) plus what a restore
is about to fetch from peers.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from elasticrun.job import env as env_names
from elasticrun.sizes import parse_size

#: The default cap's share of /dev/shm and of the container's memory limit.
DEFAULT_SHARE = 0.5
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63-1


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _limit(text: Optional[str]) -> Optional[int]:
    if text is None or not text.isdigit():
        return None  # absent, "max" (v2: no limit) or unreadable
    value = int(text)
    return value if 0 < value < _UNLIMITED else None


def cgroup_memory_limit(root: str = "/") -> Optional[int]:
    """This process's container memory limit in bytes (cgroup v2 ``memory.max``, else v1
    ``memory.limit_in_bytes``; the own cgroup's file first, then the mount's top), or None.
    ``root`` is the filesystem root to read ``proc/self/cgroup`` and ``sys/fs/cgroup`` under."""
    cg = os.path.join(root, "sys", "fs", "cgroup")
    v2_path = v1_path = ""
    for line in (_read(os.path.join(root, "proc", "self", "cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2].lstrip("/")
        elif "memory" in parts[1].split(","):
            v1_path = parts[2].lstrip("/")
    for where in (os.path.join(cg, v2_path, "memory.max"), os.path.join(cg, "memory.max"),
                  os.path.join(cg, "memory", v1_path, "memory.limit_in_bytes"),
                  os.path.join(cg, "memory", "memory.limit_in_bytes")):
        limit = _limit(_read(where))
        if limit is not None:
            return limit
    return None


def default_cap(shm_size: int, container_limit: Optional[int]) -> int:
    """The cap when none is given: :data:`DEFAULT_SHARE` of ``shm_size``, and of ``container_limit``."""
    cap = int(shm_size * DEFAULT_SHARE)
    if container_limit is not None:
        cap = min(cap, int(container_limit * DEFAULT_SHARE))
    return cap


def memory_cap(base: str, root: str = "/") -> Tuple[int, str]:
    """``(cap in bytes, where it comes from)`` for the snapshot directory ``base``: the
    ``ELASTICRUN_SNAPSHOT_MEMORY`` size, else :func:`default_cap`. A bad size raises ValueError."""
    text = os.environ.get(env_names.SNAPSHOT_MEMORY, "").strip()
    if text:
        return parse_size(text), env_names.SNAPSHOT_MEMORY
    st = os.statvfs(base)
    return (default_cap(st.f_blocks * st.f_frsize, cgroup_memory_limit(root)),
            "the default cap (half of shared memory and of the container's memory limit)")


def dir_bytes(path: str) -> int:
    """The memory the files under ``path`` take (allocated blocks; hard links counted once)."""
    total, seen = 0, set()
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


__all__ = ["DEFAULT_SHARE", "cgroup_memory_limit", "default_cap", "dir_bytes", "memory_cap"]
