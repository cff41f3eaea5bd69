"""Bring every file of a memory generation onto every node, from its peers' memory.

:func:`materialize` (collective) runs before a memory generation is loaded. A node that
holds every file in its own ``generations/<name>/`` loads from there (a worker restarted
on the same node). Any other node — one that lost a peer (its parts are in a survivor's
``replicas/``), or a newcomer after a scale-up (it has nothing) — gets
``<snapshot dir>/restore/<name>/``: hard links to what it holds locally, plus the missing
files fetched from the first node that holds each one, over the process group
(point-to-point, in one global order that every rank computes alike: deadlock-free). The
normal resharding reader then loads from there at any world size.

Integrity: every file of a memory generation was hashed once — by the rank that wrote it
(the checksum in ``metadata.json`` is computed over the bytes written) or on receipt (a
replica, a fetched file: checked against ``metadata.json`` before use). Restore checks
every file's size (and the reader checks every safetensors header against the metadata)
but does not hash local memory again: that keeps a memory restore a copy from RAM rather
than a checksum pass over the whole state. Disk checkpoints are always hashed on load.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta
from elasticrun.checkpoint.memory.commit import NodeLayout
from elasticrun.checkpoint.memory.replicas import recv_file, send_file
from elasticrun.checkpoint.memory.restore import gather_inventories
from elasticrun.errors import CheckpointError
from elasticrun.job.shm import GENERATIONS, REPLICAS, ShmLayout, snapshot_dir


def _local_path(base: str, name: str, fname: str) -> Optional[str]:
    for sub in (GENERATIONS, REPLICAS):
        p = os.path.join(base, sub, name, fname)
        if os.path.exists(p):
            return p
    return None


def materialize(name: str, process_group: Any = None) -> Tuple[str, Dict[str, int]]:
    """Make generation ``name`` loadable on every node (collective). Returns the checkpoint
    root to load it from on this rank and what was fetched (``{"files": n, "bytes": b}`` for
    this node). Raises :class:`CheckpointError` on every rank alike when it cannot."""
    comm = Comm(process_group)
    dirs, invs = gather_inventories(comm)
    if any(d is None for d in dirs):
        raise CheckpointError(f"memory snapshot {name!r}: a rank has no memory tier")
    layout = NodeLayout.from_dirs([d or "" for d in dirs], comm.rank)
    have = [invs[ranks[0]].get(name, {"gen": [], "rep": []}) for ranks in layout.nodes]
    holder = next((ranks[0] for ranks, h in zip(layout.nodes, have) if h["gen"] or h["rep"]), None)
    base = snapshot_dir() or ""
    meta_bytes: Optional[bytes] = None
    if comm.rank == holder:
        p = next((os.path.join(base, sub, name, METADATA_FILE) for sub in (GENERATIONS, REPLICAS)
                  if os.path.exists(os.path.join(base, sub, name, METADATA_FILE))), None)
        if p is not None:
            with open(p, "rb") as f:
                meta_bytes = f.read()
    got = comm.all_gather(meta_bytes if comm.rank == holder else None)
    raw = got[holder] if holder is not None else None
    if raw is None:
        raise CheckpointError(f"memory snapshot {name!r} is no longer in memory")
    meta = CheckpointMeta.loads(raw, f"memory snapshot {name}")

    # Every transfer (file, from node, to node), in one order computed alike on every rank.
    local_all = [set(h["gen"]) == set(meta.files) for h in have]
    present = [set(h["gen"]) | set(h["rep"]) for h in have]
    transfers: List[Tuple[str, int, int]] = []
    for n in range(len(layout.nodes)):
        if local_all[n]:
            continue
        for fname in sorted(set(meta.files) - present[n]):
            src = next((m for m in range(len(layout.nodes)) if fname in present[m]), None)
            if src is None:
                raise CheckpointError(f"memory snapshot {name!r}: {fname} is on no node any more")
            transfers.append((fname, src, n))

    me, leader = layout.me, layout.leader
    restore = os.path.join(ShmLayout(base).restore, name)
    problems: List[str] = []
    fetched = {"files": 0, "bytes": 0}
    if leader and not local_all[me]:
        shutil.rmtree(restore, ignore_errors=True)
        os.makedirs(restore)
    for fname, src, dst in transfers:
        entry = meta.files[fname]
        if leader and me == src:
            problem = send_file(_local_path(base, name, fname), entry.size, layout.nodes[dst][0], comm.group)
            if problem:
                problems.append(f"memory snapshot {name!r}: {problem}")
        elif leader and me == dst:
            problem = recv_file(os.path.join(restore, fname), entry, layout.nodes[src][0], comm.group)
            if problem:
                problems.append(f"memory snapshot {name!r}: {problem}")
            fetched["files"] += 1
            fetched["bytes"] += entry.size
    if leader and not local_all[me] and not problems:
        try:
            for fname in sorted(present[me]):
                src_path = _local_path(base, name, fname)
                if src_path is None:
                    raise CheckpointError(f"memory snapshot {name!r}: {fname} vanished from this node")
                os.link(src_path, os.path.join(restore, fname))
            with open(os.path.join(restore, METADATA_FILE), "wb") as f:
                f.write(raw)
        except (OSError, CheckpointError) as err:
            problems.append(f"memory snapshot {name!r} cannot be assembled on node {me}: {err}")
    everyone = comm.all_gather(problems)
    for p in everyone:
        if p:
            release(name)
            raise CheckpointError(p[0])
    root = ShmLayout(base).generations if local_all[me] else ShmLayout(base).restore
    return root, fetched


def release(name: str) -> None:
    """Remove ``restore/<name>`` of this node (after the load; loaded maps stay valid)."""
    base = snapshot_dir()
    if base is not None:
        shutil.rmtree(os.path.join(ShmLayout(base).restore, name), ignore_errors=True)


__all__ = ["materialize", "release"]
