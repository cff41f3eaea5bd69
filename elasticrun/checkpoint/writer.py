"""``save()``: every rank writes its part of the checkpoint, rank 0 commits it.

A save is two steps so that :mod:`async_save` can run the second one on a thread:

1. :func:`prepare` (collective, cheap): flatten the state dict, gather every rank's
   tensor shapes, agree on the name and the plan (who writes which bytes).
2. :meth:`SaveJob.run` (collective, the I/O): write + fsync this rank's shard, gather the
   results (the barrier), then rank 0 writes ``metadata.json`` and commits atomically;
   any failure on any rank rolls the whole save back and raises the same CheckpointError
   on every rank. Errors are always exchanged before raising, so no rank hangs in a
   collective because another one failed.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from elasticrun.checkpoint.checksum import DEFAULT_CHECKSUM, Checksum, parse_checksum
from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.commit import commit, crash_point, new_token, rollback
from elasticrun.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    CheckpointMeta,
    Chunk,
    FileEntry,
    Placement,
    Replicate,
    Shard,
    tmp_dir_name,
    validate_name,
)
from elasticrun.checkpoint.plan import LocalInfo, SavePlan, WriteItem, make_plan
from elasticrun.checkpoint.shardfile import dtype_code, write_shard
from elasticrun.checkpoint.storage import Storage, cpu_share, default_io_threads, describe, get_storage, retry
from elasticrun.checkpoint.temps import fence_older_saves, is_disk_full, reclaim_stale_temps, write_marker
from elasticrun.checkpoint.tree import flatten
from elasticrun.checkpoint.validate import next_seq
from elasticrun.errors import CheckpointError

log = logging.getLogger(__name__)


def files_of_results(results: List[Dict[str, Any]]) -> Dict[str, FileEntry]:
    """Every rank's written files (``results[rank]["files"]`` from :meth:`SaveJob.write_own_files`)
    as metadata entries."""
    return {f: FileEntry(f, r, size, digest, Checksum(algo))
            for r, res in enumerate(results) for f, size, digest, algo in res["files"]}


def training_state_dict(training_state: Any) -> Optional[Dict[str, Any]]:
    """A TrainingState (or any object with ``to_dict``), a dict, or None -> JSON-able dict."""
    if training_state is None:
        return None
    if hasattr(training_state, "to_dict"):
        return dict(training_state.to_dict())
    if isinstance(training_state, Mapping):
        return dict(training_state)
    raise CheckpointError(f"training_state must be a TrainingState or a dict, got {type(training_state).__name__}")


def default_name(ts: Optional[Dict[str, Any]], created: float) -> str:
    """``step-00001200`` when the step is known, else a UTC timestamp."""
    if ts is not None and isinstance(ts.get("step"), int):
        return f"step-{ts['step']:08d}"
    return time.strftime("ckpt-%Y%m%d-%H%M%S", time.gmtime(created)) + f"-{int(created * 1000) % 1000:03d}"


def _placements(placements: Optional[Mapping[str, Placement]], names: Mapping[str, Any]) -> Dict[str, Placement]:
    out: Dict[str, Placement] = {}
    for key, p in (placements or {}).items():
        if key not in names:
            raise CheckpointError(f"placements names {key!r}, which is not a tensor in the state dict")
        if not isinstance(p, (Shard, Replicate)):
            raise CheckpointError(f"placement of {key!r} must be Shard(dim) or Replicate(), got {p!r}")
        out[key] = p
    return out


def source_tensor(t: torch.Tensor, item: WriteItem) -> torch.Tensor:
    """The CPU, contiguous bytes a write item covers (a view when possible, no copy)."""
    t = t.detach()
    if item.rows is not None:
        t = t[item.rows[0]:item.rows[1]]
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def device_source(t: torch.Tensor, item: WriteItem) -> torch.Tensor:
    """Like :func:`source_tensor`, but a CUDA tensor stays on its device (contiguous): the
    writer stages it through pinned buffers, overlapping the copies with writes and hashing."""
    if t.device.type != "cuda":
        return source_tensor(t, item)
    t = t.detach()
    if item.rows is not None:
        t = t[item.rows[0]:item.rows[1]]
    return t if t.is_contiguous() else t.contiguous()


@dataclass
class SaveJob:
    """Everything one rank needs to write and commit its part of a planned save."""

    storage: Storage
    name: str
    token: str
    comm: Comm
    plan: SavePlan
    sources: List[Tuple[Chunk, torch.Tensor]]  # this rank's bytes, one contiguous tensor per chunk it writes
    tree: Any
    training_state: Optional[Dict[str, Any]]
    user_metadata: Dict[str, Any]
    created: float
    keep_last: Optional[int] = None
    error: Optional[str] = None  # a local failure before run(), reported collectively by run()
    checksum: Checksum = DEFAULT_CHECKSUM  # of every shard file (agreed: rank 0's choice)

    @property
    def tmp(self) -> str:
        return self.storage.join(tmp_dir_name(self.name, self.token))

    def take_sources(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set :attr:`sources` from the flattened state: this rank's bytes, one contiguous tensor per
        chunk it writes. CUDA tensors stay on their device (:func:`device_source`: the writer copies
        them through pinned buffers, overlapped with the writes and the hashing), once every queued
        kernel, on any stream, has written them."""
        self.sources = [(i.chunk, device_source(tensors[i.name], i)) for i in self.plan.writes[self.comm.rank]]
        for dev in {t.device for _, t in self.sources if t.device.type == "cuda"}:
            torch.cuda.synchronize(dev)

    @property
    def final(self) -> str:
        return self.storage.join(self.name)

    def write_own_files(self) -> List[Tuple[str, int, str, str]]:
        """Write (and fsync) this rank's shard files, in parallel; ``[(file, size, digest, algorithm)]``."""
        rank = self.comm.rank
        sources = dict(self.sources)
        files = self.plan.files_of(rank)
        retry(lambda: self.storage.mkdirs(self.tmp), f"create {self.storage.display(self.tmp)}")
        if rank == 0:
            write_marker(self.storage, self.tmp)
        # A single file with a spare core: hash on a helper thread, overlapping the writes. Otherwise
        # (several files, one thread each, or no spare core) each writing thread hashes its own
        # pieces: steadier than more busy threads than cores.
        helper = len(files) == 1 and cpu_share() >= 2
        if len(files) == 1:
            return [self._write_file(files[0][0], files[0][1], sources, helper)]
        with ThreadPoolExecutor(len(files), thread_name_prefix="ckpt-write") as pool:
            return list(pool.map(lambda f: self._write_file(f[0], f[1], sources, helper), files))

    def _write_file(self, fname: str, items: List[WriteItem], sources: Dict[Any, torch.Tensor],
                    hash_helper: bool) -> Tuple[str, int, str, str]:
        rank, world = self.comm.rank, self.comm.world_size
        path = f"{self.tmp}/{fname}"
        slices = {i.chunk.key: {"offsets": list(i.chunk.offsets), "global_shape": list(self.plan.tensors[i.name].shape)}
                  for i in items}
        file_meta = {
            "format": f"{FORMAT_NAME}/{FORMAT_VERSION}",
            "checkpoint": self.name,
            "rank": str(rank),
            "world_size": str(world),
            "slices": json.dumps(slices, separators=(",", ":")),
        }
        tensors = [(i.chunk.key, sources[i.chunk]) for i in items]

        def op() -> Tuple[int, str]:
            f = self.storage.open_write(path)
            try:
                with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") if hash_helper else nullcontext() as pool:
                    size, digest = write_shard(f, tensors, file_meta, pool,
                                               on_piece=lambda _n: crash_point("shard-write", rank),
                                               algo=self.checksum)
                self.storage.finish_write(f)
            finally:
                f.close()
            return size, digest

        size, digest = retry(op, f"write {self.storage.display(path)}")
        return fname, size, digest, self.checksum.value

    def _write_phase(self) -> Dict[str, Any]:
        """This rank's part of the I/O, as a result to gather (never raises)."""
        rank = self.comm.rank
        try:
            if self.error:
                raise CheckpointError(self.error)
            result: Dict[str, Any] = {"files": self.write_own_files()}
            crash_point("after-shards", rank)
        except CheckpointError as err:
            result = {"error": str(err), "disk_full": is_disk_full(err)}
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            result = {"error": describe(err), "disk_full": is_disk_full(err)}
        return result

    def _make_room(self) -> None:
        """Rank 0, after a full disk: remove the temporary directories of dead saves and apply
        retention, so the one retry has a chance."""
        reclaimed = reclaim_stale_temps(self.storage, exclude=tmp_dir_name(self.name, self.token))
        deleted: List[str] = []
        if self.keep_last is not None:
            from elasticrun.checkpoint.retention import apply_keep_last

            try:
                deleted = apply_keep_last(self.storage, self.keep_last)
            except CheckpointError as err:
                log.warning("checkpoint retention failed while making room: %s", err)
        log.warning("disk full while saving %s: removed %d stale temporary director%s and %d old checkpoint(s); "
                    "retrying once", self.name, len(reclaimed), "y" if len(reclaimed) == 1 else "ies", len(deleted))

    def run(self) -> str:
        """Write this rank's shard, then commit (rank 0). Collective; returns the checkpoint name.

        A full disk on any rank: rank 0 rolls the attempt back, reclaims the temporary
        directories of dead saves and applies retention, then every rank retries once."""
        rank = self.comm.rank
        crash_point("start", rank)
        for attempt in (1, 2):
            results = self.comm.all_gather(self._write_phase())
            failed = [(r, res["error"]) for r, res in enumerate(results) if "error" in res]
            if not failed:
                break
            if attempt == 1 and any(res.get("disk_full") for res in results):
                if rank == 0:
                    rollback(self.storage, self.tmp)
                    self._make_room()
                self.comm.broadcast({})  # nobody rewrites before rank 0 made room
                continue
            note = rollback(self.storage, self.tmp) if rank == 0 else "it was rolled back"
            r, msg = failed[0]
            where = f" on rank {r}" if self.comm.world_size > 1 else ""
            raise CheckpointError(f"saving checkpoint {self.name!r} failed{where}: {msg}; {note}")

        status: Dict[str, Any] = {}
        if rank == 0:
            files = files_of_results(results)
            try:
                meta = CheckpointMeta(
                    name=self.name, world_size=self.comm.world_size, created=self.created, tensors=self.plan.tensors,
                    files=files, tree=self.tree, training_state=self.training_state,
                    user_metadata=self.user_metadata, seq=next_seq(self.storage),
                )
                commit(self.storage, self.tmp, self.final, meta.dumps(), rank)
            except Exception as err:  # noqa: BLE001 - reported to every rank below
                status = {"error": f"{err if isinstance(err, CheckpointError) else describe(err)}; "
                                   f"{rollback(self.storage, self.tmp)}"}
        status = self.comm.broadcast(status)
        if "error" in status:
            raise CheckpointError(f"committing checkpoint {self.name!r} failed: {status['error']}")
        if rank == 0 and self.keep_last is not None:
            from elasticrun.checkpoint.retention import apply_keep_last

            try:
                apply_keep_last(self.storage, self.keep_last, protect=self.name)
            except CheckpointError as err:
                log.warning("checkpoint retention failed (the new checkpoint is safe): %s", err)
        return self.name


def check_save_args(keep_last: Any, io_threads: Any) -> None:
    """A CheckpointError for a ``keep_last`` or ``io_threads`` that is not a positive integer."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive integer (got {keep_last!r})")
    if io_threads is not None and (not isinstance(io_threads, int) or io_threads < 1):
        raise CheckpointError(f"io_threads must be a positive integer (got {io_threads!r})")


def local_infos(tensors: Mapping[str, torch.Tensor], placements: Optional[Mapping[str, Placement]]) -> List[LocalInfo]:
    """What this rank contributes to the plan: each tensor's name, dtype code, local shape, placement."""
    pl = _placements(placements, tensors)
    return [(n, dtype_code(t.dtype, n), tuple(t.shape), pl.get(n, Replicate())) for n, t in tensors.items()]


def check_json(training_state: Optional[Dict[str, Any]], user_metadata: Any, tree: Any) -> None:
    """A CheckpointError when what goes into ``metadata.json`` is not JSON."""
    try:
        json.dumps([training_state, user_metadata, tree], allow_nan=True)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"training_state/user_metadata must be JSON-serialisable: {err}") from None


def first_error(gathered: List[Dict[str, Any]]) -> Optional[str]:
    """The first rank's error of a gathered step, said as every rank raises it (``rank r: ...``
    when there are several ranks), or None when every rank succeeded."""
    for r, g in enumerate(gathered):
        if g["error"]:
            return g["error"] if len(gathered) == 1 else f"rank {r}: {g['error']}"
    return None


def _open_save(storage: Storage, name: Optional[str], ts: Optional[Dict[str, Any]], algo: Checksum) -> Dict[str, Any]:
    """Rank 0: name the save, fence older rounds' saves, check the name is free; the head every rank gets."""
    created = time.time()
    final_name = validate_name(name if name is not None else default_name(ts, created))
    fence_older_saves(storage)  # a newer round opens the root: older rounds' saves can no longer commit
    _check_free(storage, final_name)
    return {"name": final_name, "token": new_token(), "created": created, "checksum": algo.value}


def prepare(
    state_dict: Mapping[str, Any],
    root: str,
    name: Optional[str],
    comm: Comm,
    *,
    training_state: Any = None,
    user_metadata: Optional[Dict[str, Any]] = None,
    placements: Optional[Mapping[str, Placement]] = None,
    keep_last: Optional[int] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    io_threads: Optional[int] = None,
    checksum: Union[str, Checksum, None] = None,
) -> Tuple[SaveJob, Dict[str, torch.Tensor]]:
    """Collective: agree on name and plan. Returns the job (no sources yet) and the local tensors."""
    error: Optional[str] = None
    infos: List[LocalInfo] = []
    head: Optional[Dict[str, Any]] = None
    tensors: Dict[str, torch.Tensor] = {}
    tree: Any = None
    ts: Optional[Dict[str, Any]] = None
    storage: Optional[Storage] = None
    try:
        check_save_args(keep_last, io_threads)
        algo = parse_checksum(checksum)
        storage = get_storage(root, storage_options)
        tensors, tree = flatten(state_dict)
        infos = local_infos(tensors, placements)
        ts = training_state_dict(training_state)
        check_json(ts, user_metadata, tree)
        if comm.rank == 0:
            head = _open_save(storage, name, ts, algo)
    except CheckpointError as err:
        error = str(err)
    threads = io_threads or default_io_threads()
    gathered = comm.all_gather({"infos": infos, "error": error, "head": head, "threads": threads})
    failed = first_error(gathered)
    if failed is not None:
        raise CheckpointError(failed)
    assert storage is not None
    head = gathered[0]["head"]
    plan = make_plan([g["infos"] for g in gathered], [g["threads"] for g in gathered])
    job = SaveJob(
        storage=storage, name=head["name"], token=head["token"], comm=comm, plan=plan, sources=[], tree=tree,
        training_state=ts, user_metadata=dict(user_metadata or {}), created=head["created"], keep_last=keep_last,
        checksum=Checksum(head["checksum"]),
    )
    return job, tensors


def _check_free(storage: Storage, name: str) -> None:
    final = storage.join(name)
    if not retry(lambda: storage.exists(final), f"check {storage.display(final)}"):
        return
    if retry(lambda: storage.exists(f"{final}/{METADATA_FILE}"), f"check {storage.display(final)}"):
        raise CheckpointError(
            f"checkpoint {name!r} already exists in {storage.display(storage.root)}: pass another name or delete "
            f"it first (elasticrun ckpt delete {storage.display(storage.root)} {name})"
        )
    if storage.atomic_rename:
        raise CheckpointError(
            f"{storage.display(final)} exists but is not a checkpoint: move it away or pick another name"
        )
    # Object stores: a half-moved directory from a crashed commit; it was never complete.
    retry(lambda: storage.remove_tree(final), f"remove incomplete {storage.display(final)}")


def save(
    state_dict: Mapping[str, Any],
    root: str,
    name: Optional[str] = None,
    *,
    training_state: Any = None,
    user_metadata: Optional[Dict[str, Any]] = None,
    placements: Optional[Mapping[str, Placement]] = None,
    process_group: Any = None,
    keep_last: Optional[int] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    io_threads: Optional[int] = None,
    checksum: Union[str, Checksum, None] = None,
) -> str:
    """Save ``state_dict`` as checkpoint ``<root>/<name>``; every rank of the group calls it.

    ``state_dict`` is a nested dict of tensors and JSON values (non-tensor leaves go into
    ``metadata.json``; nothing is pickled). Tensors are replicated (identical on every
    rank, written once with each rank writing ~1/N) unless ``placements`` marks them
    ``Shard(dim)`` (each rank holds a slice along ``dim``; slices may be uneven).
    ``name`` defaults to ``step-<step:08d>`` from ``training_state``. With ``keep_last=K``
    rank 0 deletes the oldest complete checkpoints beyond K after the commit.
    ``storage_options`` go to fsspec for URL roots (``s3://...``). ``io_threads`` is how
    many files this rank writes and hashes in parallel (default: its share of the CPUs,
    at most 4; large ranks only — one file per 64 MiB at most). ``checksum`` is the per-file
    checksum stored in ``metadata.json`` and checked on load: ``"crc32"`` (default; catches
    torn writes and bit rot at a few GB/s) or ``"sha256"`` (cryptographic, ~2.5× the CPU).
    Returns the name; raises CheckpointError (on every rank) if the save failed and was
    rolled back.
    """
    comm = Comm(process_group)
    job, tensors = prepare(
        state_dict, root, name, comm, training_state=training_state, user_metadata=user_metadata,
        placements=placements, keep_last=keep_last, storage_options=storage_options, io_threads=io_threads,
        checksum=checksum,
    )
    try:
        job.take_sources(tensors)
    except Exception as err:  # noqa: BLE001 - must still take part in the collectives
        job.sources, job.error = [], f"cannot read the tensors to save: {describe(err)}"
    return job.run()
