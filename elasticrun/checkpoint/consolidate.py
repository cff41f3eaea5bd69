"""Offline conversions: consolidated safetensors (one file, or Hugging Face shards plus their
index), a resharded copy for another world size, and importing a single-file state dict
(``.pt`` / ``.safetensors``).

These run in one process and stream tensor by tensor (consolidate) or rank by rank
(reshard), so peak memory is one tensor, resp. about 1/M of the checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from elasticrun.checkpoint import export
from elasticrun.checkpoint.checksum import DEFAULT_CHECKSUM, DISK_CHECKSUMS, Checksum, parse_checksum
from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.commit import commit, new_token, rollback
from elasticrun.checkpoint.format import CheckpointMeta, FileEntry, Shard, validate_name
from elasticrun.checkpoint.plan import make_plan
from elasticrun.checkpoint.regions import ShardFiles, read_region, region_for
from elasticrun.checkpoint.shardfile import build_header, torch_dtype
from elasticrun.checkpoint.staging import byte_view
from elasticrun.checkpoint.storage import LocalStorage, describe, get_storage
from elasticrun.checkpoint.validate import next_seq, read_meta, resolve_name, verify_files
from elasticrun.checkpoint.writer import SaveJob, _check_free, save
from elasticrun.errors import CheckpointError


def _open_checked(root: str, name: str, verify: bool, storage_options: Optional[Dict[str, Any]]):
    storage = get_storage(root, storage_options)
    name = resolve_name(storage, name)
    meta = read_meta(storage, name)
    if verify:
        problems = verify_files(storage, name, list(meta.files.values()))
        if problems:
            raise CheckpointError(problems[0])
    return storage, name, meta


def consolidate(
    root: str,
    name: str,
    out: str,
    *,
    only: Optional[str] = None,
    strip_prefix: bool = False,
    verify: bool = True,
    storage_options: Optional[Dict[str, Any]] = None,
    progress: Optional[Callable[[int], None]] = None,
    max_shard_size: Optional[int] = None,
    force: bool = False,
) -> List[str]:
    """Write checkpoint ``name`` as plain safetensors with full tensors, loadable by Hugging Face.

    ``out`` ending in ``.safetensors`` (and no ``max_shard_size``): one file. Otherwise ``out`` is
    a directory that gets ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files plus
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size`` bytes (default 5 GB),
    as ``transformers``' ``save_pretrained`` writes them. Nested state dicts have dotted names
    (``model.fc.weight``); ``only`` keeps tensors whose name starts with that prefix
    (``strip_prefix`` removes it). Every file's metadata has ``format: pt`` plus the training
    state and user metadata. Existing files are kept unless ``force``; the checkpoint's own
    files never are. Returns the tensor names written.
    """
    storage, name, meta = _open_checked(root, name, verify, storage_options)
    names, keys = select_tensors(list(meta.tensors), name, only, strip_prefix)
    own_dir = storage.join(name) if isinstance(storage, LocalStorage) else None
    file_meta = {**export.FORMAT_METADATA, "elasticrun.checkpoint": name,
                 "elasticrun.training_state": json.dumps(meta.training_state),
                 "elasticrun.user_metadata": json.dumps(meta.user_metadata)}
    layout = plan_export(out, list(zip(keys, names)), {n: meta.tensors[n].nbytes for n in names}, max_shard_size)
    _prepare_target(layout, out, force, own_dir)
    shard_files = ShardFiles(storage, name, meta)
    written: List[str] = []
    try:
        for path, items in layout.files:
            _write_file(path, items, meta, shard_files, file_meta, progress)
            written.append(path)
        if layout.index is not None:
            index_path = os.path.join(out, export.INDEX_FILE)
            tmp = f"{index_path}.tmp-{new_token()}"
            with open(tmp, "w") as f:
                f.write(layout.index)
            os.replace(tmp, index_path)
    except OSError as err:
        raise CheckpointError(f"cannot write {out}: {describe(err)}") from None
    finally:
        shard_files.close()
    return keys


def select_tensors(tensor_names: Sequence[str], name: str, only: Optional[str],
                   strip_prefix: bool) -> Tuple[List[str], List[str]]:
    """``(names, keys)``: the checkpoint's tensors that ``only`` keeps and the names they are written
    under (``only`` removed when ``strip_prefix``); raises when none is kept or a key would be empty."""
    names = [n for n in tensor_names if only is None or n.startswith(only)]
    if not names:
        raise CheckpointError(f"checkpoint {name!r} has no tensor starting with {only!r}")
    keys = [n[len(only):] if strip_prefix and only else n for n in names]
    if any(not k for k in keys):
        raise CheckpointError(f"--only {only!r} with --strip-prefix leaves an empty tensor name")
    return names, keys


@dataclass(frozen=True)
class ExportPlan:
    """What :func:`consolidate` writes: each file's path and its ``[(key written, checkpoint name)]``,
    the index's text (several files only), and whether ``out`` is a directory."""

    files: List[Tuple[str, List[Tuple[str, str]]]]
    index: Optional[str]
    directory: bool


def plan_export(out: str, items: List[Tuple[str, str]], nbytes: Dict[str, int],
                max_shard_size: Optional[int]) -> ExportPlan:
    """The files of an export of ``items`` (``[(key, checkpoint name)]``; ``nbytes`` by checkpoint
    name) to ``out``: one file when it ends in ``.safetensors`` and no shard size is given, else
    Hugging Face shards of at most ``max_shard_size`` bytes in the directory ``out``."""
    if out.endswith(".safetensors") and max_shard_size is None:
        return ExportPlan([(out, list(items))], None, directory=False)
    if out.endswith(".safetensors"):
        raise CheckpointError(f"--out {out}: --max-shard-size writes a directory; give a directory name")
    limit = max_shard_size or export.DEFAULT_MAX_SHARD_SIZE
    groups = export.split_shards([(k, nbytes[n]) for k, n in items], limit)
    files = export.shard_file_names(len(groups))
    by_key = dict(items)
    plan = [(os.path.join(out, f), [(k, by_key[k]) for k in g]) for f, g in zip(files, groups)]
    weight_map = {k: f for f, g in zip(files, groups) for k in g}
    total = sum(nbytes[n] for _k, n in items)
    index = export.index_json(weight_map, total) if len(groups) > 1 else None
    return ExportPlan(plan, index, directory=True)


def _prepare_target(layout: ExportPlan, out: str, force: bool, own_dir: Optional[str]) -> None:
    """Refuse existing files (unless ``force``) and the checkpoint's own; for a directory, create it
    and remove a previous export's shards that this one does not overwrite."""
    if not layout.directory:
        export.check_target([out], force, own_dir)
        return
    paths = {p for p, _ in layout.files}
    stale = [os.path.join(out, f) for f in export.existing_export_files(out)]
    export.check_target([p for p, _ in layout.files] + [os.path.join(out, export.INDEX_FILE)] + stale, force, own_dir)
    try:
        os.makedirs(out, exist_ok=True)
        for path in stale:  # a previous export's shards (--force): gone, so no mix of old and new
            if path not in paths:
                os.remove(path)
    except OSError as err:
        raise CheckpointError(f"cannot write {out}: {describe(err)}") from None


def _write_file(
    out: str,
    items: List[Tuple[str, str]],
    meta: CheckpointMeta,
    files: ShardFiles,
    file_meta: Dict[str, str],
    progress: Optional[Callable[[int], None]],
) -> None:
    """One safetensors file ``out`` with the full tensors ``items`` = [(key written, checkpoint name)]."""
    header = [(k, meta.tensors[n].dtype, meta.tensors[n].shape, meta.tensors[n].nbytes) for k, n in items]
    tmp = f"{out}.tmp-{new_token()}"
    try:
        with open(tmp, "wb", buffering=0) as f:
            f.write(build_header(header, file_meta))
            for _, n in items:
                entry = meta.tensors[n]
                t = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
                read_region(files, entry, [0] * len(entry.shape), t)
                view = byte_view(t)
                while len(view):
                    view = view[f.write(view):]
                if progress is not None:
                    progress(entry.nbytes)
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def reshard(
    root: str,
    name: str,
    world_size: int,
    out_root: str,
    out_name: Optional[str] = None,
    *,
    verify: bool = True,
    storage_options: Optional[Dict[str, Any]] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> str:
    """Rewrite checkpoint ``name`` as a checkpoint for ``world_size`` ranks (in ``out_root``).

    Sharded tensors are split evenly (``torch.tensor_split``) along their dim; replicated
    ones are re-split so each new rank's file holds about 1/M. Returns the new name.
    """
    if world_size < 1:
        raise CheckpointError(f"--world-size must be at least 1 (got {world_size})")
    storage, name, meta = _open_checked(root, name, verify, storage_options)
    out_storage = get_storage(out_root, storage_options)
    out_name = validate_name(out_name or name)
    _check_free(out_storage, out_name)
    infos = []
    for r in range(world_size):
        rank_infos = []
        for t in meta.tensors.values():
            _, shape = region_for(t, t.placement, r, world_size)
            rank_infos.append((t.name, t.dtype, tuple(shape), t.placement))
        infos.append(rank_infos)
    plan = make_plan(infos)
    token = new_token()
    algos = {f.algo for f in meta.files.values()}
    algo = algos.pop() if len(algos) == 1 else DEFAULT_CHECKSUM  # keep the source's choice (of the disk ones)
    algo = algo if algo in DISK_CHECKSUMS else DEFAULT_CHECKSUM
    files = ShardFiles(storage, name, meta)
    results: Dict[str, FileEntry] = {}
    job = None
    try:
        for r in range(world_size):
            job = SaveJob(storage=out_storage, name=out_name, token=token, comm=Comm.local(r, world_size), plan=plan,
                          sources=[], tree=meta.tree, training_state=meta.training_state,
                          user_metadata=meta.user_metadata, created=time.time(), checksum=algo)
            for item in plan.writes[r]:
                entry = meta.tensors[item.name]
                t = torch.empty(item.chunk.shape, dtype=torch_dtype(entry.dtype))
                read_region(files, entry, item.chunk.offsets, t)
                job.sources.append((item.chunk, t))
            for fname, size, digest, written_algo in job.write_own_files():
                results[fname] = FileEntry(fname, r, size, digest, Checksum(written_algo))
                if progress is not None:
                    progress(size)
            job.sources = []
        assert job is not None
        # A commit sequence number like any save's: in a job's root, the resharded checkpoint of the
        # newest step is "latest" (docs/checkpoints.md, Ordering).
        new_meta = CheckpointMeta(name=out_name, world_size=world_size, created=time.time(), tensors=plan.tensors,
                                  files=results, tree=meta.tree, training_state=meta.training_state,
                                  user_metadata=meta.user_metadata, seq=next_seq(out_storage))
        commit(out_storage, job.tmp, job.final, new_meta.dumps(), 0)
    except BaseException as err:
        note = rollback(out_storage, out_storage.join(f".{out_name}.tmp-{token}"))
        if isinstance(err, CheckpointError):
            raise CheckpointError(f"{err}; {note}") from None
        raise
    finally:
        files.close()
    return out_name


def import_file(path: str, root: str, name: str, *, storage_options: Optional[Dict[str, Any]] = None,
                checksum: Optional[str] = None) -> str:
    """Save a single-file state dict (``torch.save`` file loaded with ``weights_only=True``, or a
    ``.safetensors`` file) as checkpoint ``<root>/<name>`` (``checksum``: as for ``save``)."""
    parse_checksum(checksum)  # a bad choice fails before the file is read
    if not os.path.isfile(path):
        raise CheckpointError(f"--from {path}: no such file")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state: Any = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any parse failure is the file's fault
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"cannot read {path} as a state dict ({err.__class__.__name__}: {first})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    return save(state, root, name, user_metadata={"imported_from": os.path.basename(path)},
                storage_options=storage_options, checksum=checksum)


__all__ = ["ExportPlan", "Shard", "consolidate", "import_file", "plan_export", "reshard", "select_tensors"]
