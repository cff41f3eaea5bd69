"""Persisting a committed memory generation to a disk root, with the save's atomic commit.

One node (:func:`persist_generation`): rank 0 holds every file and copies them all. Several
nodes (:func:`persist_across_nodes`): each node's leader copies its own parts into the same
temporary directory of the (shared) disk root, the ranks agree that every copy succeeded, and
rank 0 checks that every file is there and commits — as a collective save would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from elasticrun.checkpoint.checksum import DEFAULT_CHECKSUM, DISK_CHECKSUMS, Digest
from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta, FileEntry, tmp_dir_name
from elasticrun.errors import CheckpointError
from elasticrun.job.shm import ShmLayout

log = logging.getLogger(__name__)


def _copy_checked(src_path: str, storage: Any, dst: str, entry: FileEntry, name: str) -> FileEntry:
    """Copy one file to ``dst`` on ``storage``, checking its checksum on the way; returns its entry
    for the disk checkpoint (a memory snapshot's ``wordsum`` becomes CRC-32, computed on the way:
    checkpoints on disk carry only the public format's checksums)."""
    check = Digest(entry.algo)
    disk = None if entry.algo in DISK_CHECKSUMS else Digest(DEFAULT_CHECKSUM)
    with open(src_path, "rb") as src:
        out = storage.open_write(dst)
        try:
            while True:
                chunk = src.read(8 << 20)
                if not chunk:
                    break
                check.update(chunk)
                if disk is not None:
                    disk.update(chunk)
                out.write(chunk)
            storage.finish_write(out)
        finally:
            out.close()
    if check.hexdigest() != entry.digest:
        raise CheckpointError(f"{entry.name} of snapshot {name!r} does not match its {entry.algo.value} "
                              "(memory corrupted?)")
    return entry if disk is None else replace(entry, digest=disk.hexdigest(), algo=disk.algo)


def persist_generation(src_dir: str, name: str, disk_root: str, keep_last: Optional[int] = None,
                       storage_options: Optional[Dict[str, Any]] = None) -> str:
    """Copy the committed generation in ``src_dir`` to ``<disk_root>/<name>`` with the save's
    atomic commit (shards to a temporary directory, fsync, checksums checked and CRC-32 computed
    while copying, ``metadata.json`` last, rename). Returns the name; raises CheckpointError (rolled back)."""
    from elasticrun.checkpoint.commit import commit, new_token, rollback
    from elasticrun.checkpoint.retention import apply_keep_last
    from elasticrun.checkpoint.storage import get_storage
    from elasticrun.checkpoint.temps import write_marker
    from elasticrun.checkpoint.validate import next_seq

    with open(os.path.join(src_dir, METADATA_FILE), "rb") as f:
        meta = CheckpointMeta.loads(f.read(), os.path.join(src_dir, METADATA_FILE))
    storage = get_storage(disk_root, storage_options)
    storage.mkdirs(storage.root)
    final = storage.join(name)
    if storage.exists(final):
        return name  # already persisted
    tmp = storage.join(tmp_dir_name(name, new_token()))
    try:
        storage.mkdirs(tmp)
        write_marker(storage, tmp)
        for fname, entry in sorted(meta.files.items()):
            meta.files[fname] = _copy_checked(os.path.join(src_dir, fname), storage, f"{tmp}/{fname}", entry, name)
        meta.seq = next_seq(storage)
        commit(storage, tmp, final, meta.dumps(), 0)
    except Exception as err:
        note = rollback(storage, tmp)
        raise CheckpointError(f"persisting snapshot {name!r} to {disk_root} failed: {err}; {note}") from None
    if keep_last is not None:
        apply_keep_last(storage, keep_last, protect=name)
    return name


@dataclass
class _NodePart:
    """What one node's leader copied of a generation into the disk root's temporary directory."""

    storage: Any = None
    tmp: str = ""
    final: str = ""
    meta: Optional[CheckpointMeta] = None
    copied: List[FileEntry] = field(default_factory=list)  # this node's files as the disk checkpoint lists them
    error: Optional[str] = None


def persist_across_nodes(base: str, name: str, layout: Any, group: Any, disk_root: str,
                         keep_last: Optional[int] = None) -> Optional[str]:
    """Collective over ``group`` (every rank of the snapshot's group calls it, in the same order):
    persist generation ``name`` of a job spanning several nodes to ``disk_root``, which every node
    must reach (a shared filesystem, as for :func:`~elasticrun.checkpoint.save`). Returns the
    name on rank 0 when it committed, else None; a failure is logged and rolled back, never raised
    (training goes on; a later generation is persisted instead)."""
    import torch.distributed as dist

    from elasticrun.checkpoint.retention import apply_keep_last

    part = _copy_node_part(base, name, layout, disk_root)
    results: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(results, (part.error, part.copied), group=group)
    done: List[Optional[str]] = [None]
    if dist.get_rank(group) == 0:
        done[0] = _commit_parts(part, results, name, disk_root)
    dist.broadcast_object_list(done, src=dist.get_global_rank(group, 0), group=group)
    if done[0] is None:
        if layout.leader and part.storage is not None and part.tmp:
            try:  # a disk root that is not shared leaves each node's part here
                part.storage.remove_tree(part.tmp)
            except Exception:  # noqa: BLE001 - already gone (a shared root: rank 0 rolled it back)
                pass
        return None
    if dist.get_rank(group) == 0 and keep_last is not None:
        apply_keep_last(part.storage, keep_last, protect=name)
    return done[0] if dist.get_rank(group) == 0 else None


def _copy_node_part(base: str, name: str, layout: Any, disk_root: str) -> _NodePart:
    """On a node's leader: copy the node's files of generation ``name`` into the temporary
    directory of ``disk_root`` (the same on every node). A failure is recorded, not raised."""
    from elasticrun.checkpoint.storage import get_storage

    token = hashlib.sha256(name.encode()).hexdigest()[:12]  # the same temporary directory on every node
    part = _NodePart()
    stage = os.path.join(ShmLayout(base).persist, name)
    try:
        part.storage = storage = get_storage(disk_root)
        part.tmp, part.final = storage.join(tmp_dir_name(name, token)), storage.join(name)
        if layout.leader:
            gen = os.path.join(ShmLayout(base).generations, name)
            with open(os.path.join(gen, METADATA_FILE), "rb") as f:
                part.meta = CheckpointMeta.loads(f.read(), os.path.join(gen, METADATA_FILE))
            mine: List[FileEntry] = layout.files_of_node(part.meta, layout.me)
            shutil.rmtree(stage, ignore_errors=True)
            os.makedirs(stage)
            for e in mine:  # hard links pin the files: retention may drop the generation meanwhile
                os.link(os.path.join(gen, e.name), os.path.join(stage, e.name))
            storage.mkdirs(part.tmp)
            part.copied = [_copy_checked(os.path.join(stage, e.name), storage, f"{part.tmp}/{e.name}", e, name)
                           for e in mine]
    except Exception as err:  # noqa: BLE001 - agreed on below
        part.error = f"node {layout.me}: {err}"
    finally:
        if layout.leader:  # the stage is the leader's: another rank of the node removing it would cut its copy
            shutil.rmtree(stage, ignore_errors=True)
    return part


def _commit_parts(part: _NodePart, results: List[Any], name: str, disk_root: str) -> Optional[str]:
    """On rank 0: check that every node copied its part and commit; ``name``, or None (logged, rolled back)."""
    from elasticrun.checkpoint.commit import commit, rollback
    from elasticrun.checkpoint.temps import write_marker
    from elasticrun.checkpoint.validate import next_seq

    storage, tmp, meta = part.storage, part.tmp, part.meta
    try:
        bad = first_node_error(results)
        if bad is not None:
            raise CheckpointError(bad)
        assert meta is not None and storage is not None
        meta.files.update({e.name: e for _p, files in results for e in files})
        sizes = {f: storage.size(f"{tmp}/{f}") if storage.exists(f"{tmp}/{f}") else None for f in sorted(meta.files)}
        missing = missing_files(meta.files, sizes)
        if missing:
            raise CheckpointError(f"{missing[0]} is not in {storage.display(tmp)} (is the disk root shared "
                                  "by every node?)")
        write_marker(storage, tmp)
        meta.seq = next_seq(storage)
        commit(storage, tmp, part.final, meta.dumps(), 0)
        return name
    except Exception as err:  # noqa: BLE001 - a failed copy must not stop training
        note = rollback(storage, tmp) if storage is not None and tmp else ""
        log.warning("snapshot %s was not persisted to %s: %s; %s", name, disk_root, err, note)
        return None


def first_node_error(results: Sequence[Tuple[Optional[str], Any]]) -> Optional[str]:
    """The first error among the nodes' gathered ``(error, copied files)``, or None."""
    return next((p for p, _files in results if p), None)


def missing_files(files: Dict[str, FileEntry], sizes: Dict[str, Optional[int]]) -> List[str]:
    """The names in ``files``, in order, whose copy is absent (size None) or of another size."""
    return [f for f, e in sorted(files.items()) if sizes.get(f) is None or sizes[f] != e.size]


__all__ = ["first_node_error", "missing_files", "persist_across_nodes", "persist_generation"]
