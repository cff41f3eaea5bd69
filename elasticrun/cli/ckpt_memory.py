"""The memory tier as ``elasticrun ckpt list --memory`` sees it: this machine's agents' snapshots.

Every agent keeps its node's memory snapshots in ``/dev/shm/elasticrun-snap-<job>-<node
hash>-<agent pid>/`` (see :mod:`elasticrun.job.shm`): ``generations/`` holds the
generations its ranks wrote (on a multi-node job: this node's parts plus the global
``metadata.json``), ``replicas/`` the copies of a peer node's parts. :func:`memory_rows`
reads those directories of the current user (no torch, nothing written) and returns one
:class:`MemoryRow` per entry, with the same statuses as the disk listing plus ``partial``:
a committed generation of which this node holds only its own parts (the rest lives in the
other nodes' memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from elasticrun.checkpoint.storage import get_storage
from elasticrun.checkpoint.validate import CheckpointInfo, CheckpointStatus, scan
from elasticrun.job.shm import KINDS, SHM_DIR, job_part, parse_root_name
from elasticrun.proc import pid_alive


@dataclass
class SnapshotDir:
    """One agent's snapshot directory."""

    path: str
    job: str  # the job id as the directory name spells it ('-' and other symbols as '_')
    agent_pid: int

    @property
    def agent_alive(self) -> bool:
        return pid_alive(self.agent_pid)


@dataclass
class MemoryRow:
    """A memory-tier entry: the disk listing's :class:`CheckpointInfo` plus where it lives."""

    info: CheckpointInfo
    where: SnapshotDir
    kind: str  # "generation" or "replica"
    root: str  # the directory it is an entry of (``<snapshot dir>/generations``)
    files_here: Optional[int] = None
    files_total: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        doc = self.info.to_json()
        doc.update(tier="memory", kind=self.kind, root=self.root, job=self.where.job, agent_pid=self.where.agent_pid,
                   agent_alive=self.where.agent_alive, files_here=self.files_here, files_total=self.files_total)
        return doc


def snapshot_dirs(shm_dir: str = SHM_DIR, job_id: Optional[str] = None) -> List[SnapshotDir]:
    """The current user's agent snapshot directories in ``shm_dir`` (of ``job_id`` only, if given)."""
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    uid = os.getuid()
    found = []
    for entry in entries:
        parsed = parse_root_name(entry)
        path = os.path.join(shm_dir, entry)
        if parsed is None or (job_id is not None and parsed[0] != job_part(job_id)):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not os.path.isdir(path) or os.path.islink(path):
            continue
        job, _node, pid = parsed
        found.append(SnapshotDir(path, job, pid))
    return found


def _mark_partial(root: str, info: CheckpointInfo) -> None:
    """A committed generation whose only missing files are the other nodes' parts is ``partial``."""
    meta = info.meta
    if meta is None:
        return  # no readable metadata: corrupt, as the disk listing says
    here = 0
    for fname, entry in meta.files.items():
        try:
            size = os.path.getsize(os.path.join(root, info.dirname, fname))
        except OSError:
            continue
        if size != entry.size:
            return  # a damaged file: stays corrupt
        here += 1
    info.status = CheckpointStatus.PARTIAL
    info.problem = f"{here} of {len(meta.files)} files here (the rest in other nodes' memory)"


def memory_rows(shm_dir: str = SHM_DIR, job_id: Optional[str] = None) -> List[MemoryRow]:
    """Every generation and replica in the current user's snapshot directories, oldest step first."""
    rows: List[MemoryRow] = []
    for d in snapshot_dirs(shm_dir, job_id):
        for sub, kind in KINDS.items():
            root = os.path.join(d.path, sub)
            if not os.path.isdir(root):
                continue
            try:
                infos = scan(get_storage(root))
            except Exception:  # noqa: BLE001 - a directory removed while we look (its agent exited)
                continue
            for info in infos:
                if info.status == CheckpointStatus.CORRUPT:
                    _mark_partial(root, info)
                row = MemoryRow(info, d, kind, root)
                if info.meta is not None:
                    row.files_total = len(info.meta.files)
                    row.files_here = sum(os.path.exists(os.path.join(root, info.dirname, f)) for f in info.meta.files)
                rows.append(row)
    rows.sort(key=lambda r: (r.info.meta is None, -1 if r.info.meta is None else r.info.meta.step or -1,
                             r.kind != "generation", r.where.path, r.info.order_key()))
    return rows


__all__ = ["MemoryRow", "SnapshotDir", "memory_rows", "snapshot_dirs"]
