"""Which checkpoint to resume from when there are two tiers: memory snapshots and disk.

A memory generation may be spread over several nodes: each node's ``generations/<name>/``
holds the parts its ranks wrote, ``replicas/<name>/`` the parts of its ring predecessor
(:mod:`elasticrun.checkpoint.memory.replicas`), each with the generation's global
``metadata.json``. :func:`candidates` (collective) gathers every node's
:func:`memory_inventory` and lists a generation only when the union of all nodes' parts and
replicas holds every file of its metadata (with the right size) — a generation torn by a
crash on any rank or node is never a candidate. Disk checkpoints come from rank 0's view
of the disk root. Newest training step first; at equal steps memory first (it loads faster).
``elasticrun.train.load_latest`` tries them in that order, fetching missing memory parts
from peers first (:func:`elasticrun.checkpoint.memory.fetch.materialize`).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Set, Tuple

from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta
from elasticrun.checkpoint.memory.commit import committed
from elasticrun.checkpoint.reader import LoadedCheckpoint
from elasticrun.checkpoint.validate import CheckpointStatus
from elasticrun.job import env as env_names
from elasticrun.job.shm import GENERATIONS, REPLICAS, ShmLayout, generations_root, snapshot_dir

log = logging.getLogger(__name__)


class Tier(str, enum.Enum):
    """Where a checkpoint lives."""

    MEMORY = "memory"
    DISK = "disk"


@dataclass
class ResumedCheckpoint(LoadedCheckpoint):
    """A :class:`LoadedCheckpoint` plus the tier and root it was loaded from."""

    tier: str = Tier.DISK.value
    root: str = ""

    @classmethod
    def of(cls, ckpt: LoadedCheckpoint, tier: Tier, root: str) -> ResumedCheckpoint:
        return cls(**{f.name: getattr(ckpt, f.name) for f in fields(LoadedCheckpoint)}, tier=tier.value, root=root)


class PartKind(str, enum.Enum):
    """Whose parts a memory directory holds."""

    GENERATION = "generation"  # written by this node's ranks
    REPLICA = "replica"  # the ring predecessor's parts, received and checksum-checked


@dataclass
class MemoryGeneration:
    """One committed generation (or replica) directory in a node's snapshot directory."""

    name: str
    step: Optional[int]
    kind: PartKind
    path: str
    files_present: List[str]  # files of the metadata present here with their recorded size
    files_total: int  # files in the generation's (global) metadata
    bytes: int  # bytes of files_present
    meta: CheckpointMeta = field(repr=False)


def files_digest(meta: CheckpointMeta) -> str:
    """Identifies a generation's content: its file names and checksums."""
    return hashlib.sha256(repr(sorted((n, e.digest) for n, e in meta.files.items())).encode()).hexdigest()


def memory_inventory(base: Optional[str] = None) -> List[MemoryGeneration]:
    """Every committed generation and replica in a node's snapshot directory (default: this
    process's ``ELASTICRUN_SNAPSHOT_DIR``), oldest first; torn ones (no metadata.json) are left out."""
    base = base or snapshot_dir()
    out: List[MemoryGeneration] = []
    if base is None:
        return out
    for kind, sub in ((PartKind.GENERATION, GENERATIONS), (PartKind.REPLICA, REPLICAS)):
        root = os.path.join(base, sub)
        for _step, _t, name in committed(root):
            path = os.path.join(root, name)
            try:
                with open(os.path.join(path, METADATA_FILE), "rb") as f:
                    meta = CheckpointMeta.loads(f.read(), os.path.join(path, METADATA_FILE))
            except Exception:  # noqa: BLE001 - unreadable, hostile or removed meanwhile: not a candidate
                continue
            present, size = [], 0
            for fname, entry in meta.files.items():
                try:
                    if os.stat(os.path.join(path, fname)).st_size == entry.size:
                        present.append(fname)
                        size += entry.size
                except OSError:
                    pass
            out.append(MemoryGeneration(name, meta.step, kind, path, sorted(present), len(meta.files), size, meta))
    return out


def failed_restores(base: Optional[str] = None) -> Set[str]:
    """The generations whose restore failed on this node (:func:`mark_failed`)."""
    base = base or snapshot_dir()
    try:
        with open(ShmLayout(base or "").failed_restores, encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip()}
    except OSError:
        return set()


def mark_failed(name: str, base: Optional[str] = None) -> None:
    """Record that restoring generation ``name`` failed: no restore of this job tries it again
    (:func:`gather_inventories` leaves out a generation that any node marked)."""
    base = base or snapshot_dir()
    if base is None or name in failed_restores(base):
        return
    try:
        with open(ShmLayout(base).failed_restores, "a", encoding="utf-8") as f:
            f.write(name + "\n")
    except OSError as err:  # the collective decision still skips it in this restore
        log.warning("cannot record the failed restore of %s: %s", name, err)


def gather_inventories(comm: Any, memory: bool = True) -> Tuple[List[Optional[str]], List[Dict[str, Any]]]:
    """Collective: every rank's snapshot directory (real path, or None) and a summary of its
    inventory: ``{name: {"step", "digest", "seq", "gen": [files], "rep": [files], "files": n}}``;
    a generation whose restore failed on any node (:func:`mark_failed`) is left out everywhere."""
    base = snapshot_dir() if memory else None
    summary: Dict[str, Any] = {}
    for g in memory_inventory(base) if base else []:
        s = summary.setdefault(g.name, {"step": g.step, "digest": files_digest(g.meta), "seq": g.meta.seq or 0,
                                        "files": g.files_total, "gen": [], "rep": []})
        if s["digest"] != files_digest(g.meta):
            s["conflict"] = True
        s["gen" if g.kind is PartKind.GENERATION else "rep"] += g.files_present
    failed = sorted(failed_restores(base)) if base else []
    gathered = comm.all_gather({"dir": os.path.realpath(base) if base else None, "inv": summary, "failed": failed})
    skip = {n for g in gathered for n in g["failed"]}
    return [g["dir"] for g in gathered], [{n: s for n, s in g["inv"].items() if n not in skip} for g in gathered]


def complete_generations(dirs: List[Optional[str]], invs: List[Dict[str, Any]]) -> List[Tuple[int, int, str]]:
    """``[(step, seq, name)]`` of the generations whose every file is present on some node."""
    if not invs or any(d is None for d in dirs):
        return []  # a rank without a memory tier could not take part in a memory restore
    out = []
    for name in sorted({n for inv in invs for n in inv}):
        holders = [inv[name] for inv in invs if name in inv]
        if len({h["digest"] for h in holders}) != 1 or any(h.get("conflict") for h in holders):
            continue
        present = {f for h in holders for f in h["gen"] + h["rep"]}
        if len(present) == holders[0]["files"]:
            step = holders[0]["step"]
            out.append((step if step is not None else -1, holders[0]["seq"], name))
    return out


def _disk_rows(disk_root: str) -> Tuple[List[Tuple[int, int, int, str]], Optional[str]]:
    from elasticrun.checkpoint import list_checkpoints
    from elasticrun.checkpoint.storage import get_storage
    from elasticrun.checkpoint.temps import fence_older_saves
    from elasticrun.errors import CheckpointError

    try:
        fence_older_saves(get_storage(disk_root))  # a resume: older rounds' saves can no longer commit here
        infos = [i for i in list_checkpoints(disk_root)
                 if i.status == CheckpointStatus.COMPLETE and i.meta is not None and i.alias_of is None]
    except CheckpointError as err:
        return [], str(err)
    return [(i.meta.step if i.meta is not None and i.meta.step is not None else -1, 0, pos, i.name)
            for pos, i in enumerate(infos)], None


def candidates(disk_root: str, process_group: Any = None, memory: bool = True) -> List[Tuple[Tier, str, str]]:
    """``[(tier, root, name)]`` of every complete checkpoint of both tiers, newest first
    (collective: every rank gets the same list; a memory row's root is this rank's own
    generations directory — parts missing on its node are fetched by ``materialize``)."""
    from elasticrun.checkpoint.comm import Comm
    from elasticrun.errors import CheckpointError

    comm = Comm(process_group)
    dirs, invs = gather_inventories(comm, memory)
    disk, error = _disk_rows(disk_root) if comm.rank == 0 else ([], None)
    disk, error = comm.broadcast((disk, error))
    if error is not None:
        raise CheckpointError(error)
    rows: List[Tuple[int, int, int, Tier, str]] = [(s, 0, p, Tier.DISK, n) for s, _z, p, n in disk]
    rows += [(s, 1, seq, Tier.MEMORY, n) for s, seq, n in complete_generations(dirs, invs)]
    mem_root = generations_root() or ""
    return [(tier, disk_root if tier is Tier.DISK else mem_root, name)
            for _s, _t, _p, tier, name in sorted(rows, key=lambda r: r[:3], reverse=True)]


def drop_newer_generations(step: Optional[int]) -> List[str]:
    """After resuming at ``step``: remove this node's memory generations and replicas of later
    steps (they belong to a timeline the job just abandoned, e.g. when their parts on another
    node were gone). Done by local rank 0 only; returns the names removed."""
    local_rank = os.environ.get(env_names.NODE_LOCAL_RANK, os.environ.get(env_names.LOCAL_RANK, "0"))
    if local_rank != "0" or step is None:
        return []
    removed = []
    for g in memory_inventory():
        if (g.step if g.step is not None else -1) > step:
            try:
                os.unlink(os.path.join(g.path, METADATA_FILE))  # uncommit first
            except OSError:
                pass
            shutil.rmtree(g.path, ignore_errors=True)
            removed.append(g.name)
    return sorted(set(removed))


__all__ = ["MemoryGeneration", "PartKind", "ResumedCheckpoint", "Tier", "candidates", "complete_generations",
           "drop_newer_generations", "failed_restores", "files_digest", "gather_inventories", "mark_failed",
           "memory_inventory"]
