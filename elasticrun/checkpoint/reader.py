"""``load()`` at any world size: each rank reads only the byte ranges it needs.

Every rank works out its region of each tensor and the pieces of saved chunks that fill
it (:mod:`elasticrun.checkpoint.regions`), then handles the files in parallel, one thread
per file: a tensor that is exactly one saved chunk becomes a copy-on-write view of the
file's memory map (local filesystems), everything else is read into place. Each rank
checks the checksum of its 1/N of the files — while reading a file it needs whole, or with
plain reads of its own (also for a mapped file) — and the problems are exchanged so every rank
fails alike.
Loads into a caller's state dict check everything first and then read straight into its
tensors (:mod:`elasticrun.checkpoint.load_into`).
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import DTYPES, LATEST, CheckpointMeta, Chunk, Placement, TensorEntry, chunks_by_file
from elasticrun.checkpoint.load_into import check_file, digest_file, fill_bounced, fill_file, plan_pieces
from elasticrun.checkpoint.plan import numel
from elasticrun.checkpoint.regions import (
    Piece,
    ShardFiles,
    header_entry,
    read_piece,
    region_for,
    region_pieces,
)
from elasticrun.checkpoint.shardfile import PIECE, Hasher, torch_dtype
from elasticrun.checkpoint.staging import byte_view, readinto_exact
from elasticrun.checkpoint.state import TrainingState
from elasticrun.checkpoint.storage import default_io_threads, describe, get_storage
from elasticrun.checkpoint.temps import fence_older_saves
from elasticrun.checkpoint.tree import check_fits, fill_in_place, flatten, unflatten
from elasticrun.checkpoint.validate import (
    checksum_mismatch,
    meta_path,
    read_meta_bytes,
    resolve_name,
    size_problem,
    verify_file,
)
from elasticrun.errors import CheckpointError

Region = Tuple[List[int], List[int]]  # (offsets, shape) of the box of a tensor a rank gets


@dataclass
class LoadedCheckpoint:
    """What ``load`` returns: the state dict (this rank's view) and the checkpoint's metadata."""

    name: str
    state_dict: Dict[str, Any]
    training_state: Optional[TrainingState]
    user_metadata: Dict[str, Any]
    world_size: int  # the world size that saved it
    meta: CheckpointMeta


def _read_and_hash(files: ShardFiles, fname: str, pieces: List[Piece], pool: ThreadPoolExecutor) -> Optional[str]:
    """Read a file this rank needs in full front to back, hashing the bytes as they land in the
    destination tensors (one pass over the disk for data and checksum); the problem or None."""
    f, header, start = files.get(fname)
    where = files.where(fname)
    expected = files.meta.files[fname]
    hasher = Hasher(pool, expected.algo)
    head = bytearray(start)
    readinto_exact(f, 0, memoryview(head), where)
    hasher.update(memoryview(head))
    pos = start
    for piece in sorted(pieces, key=lambda p: header.get(p.chunk.key, {}).get("data_offsets", [0])[0]):
        _, off, _ = header_entry(files, piece.entry, piece.chunk)
        if off != pos:
            raise CheckpointError(f"{where}: tensor {piece.chunk.key!r} is not where metadata.json expects it")
        data = byte_view(piece.dst)
        for a in range(0, len(data), PIECE):  # piece by piece, so hashing overlaps the next read
            readinto_exact(f, pos + a, data[a:a + PIECE], where)
            hasher.update(data[a:a + PIECE])
        pos += len(data)
    if pos != expected.size:
        return f"file {fname} of checkpoint {files.name!r} has data beyond its tensors: corrupt"
    return None if hasher.hexdigest() == expected.digest else checksum_mismatch(files.name, expected)


def _map_tensor(files: ShardFiles, mm: mmap.mmap, entry: TensorEntry, chunk: Chunk) -> Optional[torch.Tensor]:
    """``chunk`` (the whole tensor) as a view of the file's memory map, or None when its bytes
    are not aligned for its dtype (safetensors packs tensors without padding)."""
    _, off, where = header_entry(files, entry, chunk)
    itemsize = DTYPES[entry.dtype][1]
    nbytes = numel(chunk.shape) * itemsize
    if nbytes == 0 or off % itemsize:
        return None
    if off + nbytes > len(mm):
        raise CheckpointError(f"{where} is truncated: tensor {chunk.key!r} runs past its end")
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
    return flat.view(torch_dtype(entry.dtype)).view(chunk.shape)


def _file_task(files: ShardFiles, fname: str, n_chunks: int, pieces: List[Piece],
               mapped: List[Tuple[TensorEntry, Chunk]], verify: bool) -> Tuple[Optional[str], Dict[str, torch.Tensor]]:
    """Everything this rank does with one file: map or read its pieces, check its checksum if asked.
    Returns the problem (or None) and the tensors it made (mapped ones, or copies where unaligned)."""
    made: Dict[str, torch.Tensor] = {}
    try:
        if mapped:
            mm = files.mapping(fname)
            for entry, chunk in mapped:
                t = _map_tensor(files, mm, entry, chunk)
                if t is None:
                    t = torch.empty(chunk.shape, dtype=torch_dtype(entry.dtype))
                    pieces = pieces + region_pieces(entry, chunk.offsets, t)
                made[entry.name] = t
            for piece in pieces:
                read_piece(files, piece)
            if verify:
                expected = files.meta.files[fname]
                problem = size_problem(files.storage, files.name, expected)
                if problem is None:
                    f, _, _ = files.get(fname)  # plain reads: far cheaper than faulting the map in cold
                    if digest_file(f, expected.size, files.where(fname), expected.algo) != expected.digest:
                        problem = checksum_mismatch(files.name, expected)
                return problem, made
            return None, made
        if verify and pieces and len(pieces) == n_chunks and all(p.whole for p in pieces):
            with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as pool:
                return _read_and_hash(files, fname, pieces, pool), made
        for piece in pieces:
            read_piece(files, piece)
    except CheckpointError:
        # A file that cannot be parsed: if its checksum is wrong too, say that (the clearer cause).
        problem = verify_file(files.storage, files.name, files.meta.files[fname]) if verify else None
        if problem:
            return problem, made
        raise
    if verify:  # read in part (or not at all): hash it separately, from the page cache usually
        return verify_file(files.storage, files.name, files.meta.files[fname]), made
    return None, made


# -- what this rank reads (pure, from the metadata) -------------------------------------------


def plan_regions(meta: CheckpointMeta, names: Sequence[str], placements: Mapping[str, Placement], rank: int,
                 world: int) -> Dict[str, Region]:
    """The region of each named tensor that ``rank`` of ``world`` loads: its own part along the
    dimension of a ``Shard`` placement (``placements`` override the saved ones), else all of it."""
    regions: Dict[str, Region] = {}
    for name in names:
        entry = meta.tensors[name]
        regions[name] = region_for(entry, placements.get(name, entry.placement), rank, world)
    return regions


def exact_chunk(entry: TensorEntry, region: Region) -> Optional[Chunk]:
    """The saved chunk that is exactly ``region`` (so it can be mapped or read in one piece), or None."""
    offsets, shape = region
    for c in entry.chunks:
        if list(c.offsets) == offsets and list(c.shape) == shape:
            return c
    return None


def file_order(files: Sequence[str], rank: int, world: int, wanted: Collection[str]) -> List[str]:
    """The ``wanted`` files in the order ``rank`` visits them: starting where its 1/``world`` share of
    the (sorted) files starts, so ranks read different files first (each cold file comes off the
    disk once; the others find it in the page cache)."""
    every = sorted(files)
    k = rank * len(every) // world
    return [f for f in every[k:] + every[:k] if f in wanted]


def hash_share(files: Sequence[str], rank: int, world: int) -> List[str]:
    """The files whose checksums ``rank`` checks: its 1/``world`` block of the sorted files."""
    every = sorted(files)
    return every[rank * len(every) // world:(rank + 1) * len(every) // world]


# -- reading it ----------------------------------------------------------------------------


def _fits(t: torch.Tensor, code: str, shape: List[int]) -> bool:
    """Whether ``t`` (the caller's target) can be read into directly: CPU, same dtype and shape, contiguous."""
    return t.device.type == "cpu" and t.dtype == torch_dtype(code) and list(t.shape) == shape and t.is_contiguous()


def _destinations(meta: CheckpointMeta, regions: Mapping[str, Region], targets: Mapping[str, torch.Tensor],
                  use_mmap: bool) -> Tuple[Dict[str, torch.Tensor], Dict[str, List[Piece]],
                                           Dict[str, List[Tuple[TensorEntry, Chunk]]]]:
    """Where each region goes: into its target when that fits, else (with ``use_mmap``, for a region
    that is one saved chunk) a map of the file, else a new tensor. Returns the tensors to fill, the
    pieces to read by file, and the chunks to map by file."""
    out: Dict[str, torch.Tensor] = {}
    by_file: Dict[str, List[Piece]] = {}
    mapped: Dict[str, List[Tuple[TensorEntry, Chunk]]] = {}
    for name, (offsets, shape) in regions.items():
        entry = meta.tensors[name]
        t = targets.get(name)
        if t is None or not _fits(t, entry.dtype, shape):
            whole = exact_chunk(entry, (offsets, shape)) if use_mmap else None
            if whole is not None:  # one saved chunk is exactly what we want: map it (no copy)
                mapped.setdefault(whole.file, []).append((entry, whole))
                continue
            t = torch.empty(shape, dtype=torch_dtype(entry.dtype))
        out[name] = t
        for piece in region_pieces(entry, offsets, t.detach()):
            by_file.setdefault(piece.chunk.file, []).append(piece)
    return out, by_file, mapped


def load_tensors(files: ShardFiles, names: Sequence[str], rank: int, world: int,
                 placements: Mapping[str, Placement], targets: Mapping[str, torch.Tensor],
                 verify: Sequence[str] = (), threads: int = 1,
                 use_mmap: bool = False) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Read this rank's region of every named tensor, into ``targets`` where they fit exactly.

    Files are handled by up to ``threads`` threads, one file each; the files in ``verify`` get
    their checksums checked (while reading them, when this rank needs them whole). With
    ``use_mmap``, a tensor without a target that is exactly one saved chunk becomes a
    copy-on-write view of the file's memory map instead of a copy.
    Returns the tensors and the checksum problems found."""
    regions = plan_regions(files.meta, names, placements, rank, world)
    out, by_file, mapped = _destinations(files.meta, regions, targets, use_mmap)
    checked = set(verify)
    order = file_order(list(files.meta.files), rank, world, set(by_file) | set(mapped) | checked)
    saved = chunks_by_file(files.meta)

    def task(f: str) -> Tuple[Optional[str], Dict[str, torch.Tensor]]:
        return _file_task(files, f, len(saved[f]), by_file.get(f, []), mapped.get(f, []), f in checked)

    with torch.no_grad():
        results = _parallel(task, order, threads)
    for _, made in results:
        out.update(made)
    return out, [p for p, _ in results if p]


def load(
    root: str,
    name: str = LATEST,
    *,
    state_dict: Optional[Dict[str, Any]] = None,
    placements: Optional[Mapping[str, Placement]] = None,
    process_group: Any = None,
    verify: bool = True,
    storage_options: Optional[Dict[str, Any]] = None,
    io_threads: Optional[int] = None,
    mmap: bool = True,
) -> LoadedCheckpoint:
    """Load checkpoint ``name`` (default: the newest complete one) at this process's world size.

    Every rank of the group calls it. Tensors saved as ``Shard(dim)`` (or given ``Shard``
    in ``placements``) come back as this rank's even part along ``dim``
    (``torch.tensor_split`` boundaries); others come back whole. With ``state_dict`` the
    tensors are loaded into it in place (only the keys it has are read) and it is
    returned as ``.state_dict``. ``verify=False`` skips the checksum check of the files.
    ``io_threads`` files are read (and hashed) at once (default: this rank's share of the CPUs).

    Tensors loaded fresh (not into ``state_dict``) that were saved whole are, on a local
    filesystem, private copy-on-write memory maps of their files — like
    ``safetensors.load_file`` or ``torch.load(mmap=True)``: no copy, pages shared by every
    rank on the node until written. ``mmap=False`` gives ordinary private memory.
    """
    comm = Comm(process_group)
    storage = get_storage(root, storage_options)
    head: Dict[str, Any] = {}
    parsed: Optional[CheckpointMeta] = None
    if comm.rank == 0:
        try:
            if name == LATEST:
                fence_older_saves(storage)  # no save of an older round becomes "latest" after this
            resolved = resolve_name(storage, name)
            raw = read_meta_bytes(storage, resolved)
            parsed = CheckpointMeta.loads(raw, meta_path(storage, resolved))  # clear errors before the others parse
            head = {"name": resolved, "meta": raw}
        except CheckpointError as err:
            head = {"error": str(err)}
    head = comm.broadcast(head)
    if "error" in head:
        raise CheckpointError(head["error"])
    name = head["name"]
    meta = parsed if parsed is not None else CheckpointMeta.loads(head["meta"], meta_path(storage, name))

    targets: Dict[str, torch.Tensor] = {}
    if state_dict is not None:
        targets, _ = flatten(state_dict)
        missing = [n for n in targets if n not in meta.tensors]
        if missing:
            raise CheckpointError(f"checkpoint {name!r} has no tensor {missing[0]!r} (and {len(missing) - 1} more)"
                                  if len(missing) > 1 else f"checkpoint {name!r} has no tensor {missing[0]!r}")
    names = list(targets) if state_dict is not None else list(meta.tensors)

    files = ShardFiles(storage, name, meta)
    # Each rank checks the checksum of its 1/N block of the files: while reading them if it reads
    # them whole (one pass), otherwise separately (from the page cache, usually).
    mine = hash_share(list(meta.files), comm.rank, comm.world_size) if verify else []
    threads = io_threads or default_io_threads()
    if state_dict is not None:
        try:
            loaded = _load_in_place(files, comm, state_dict, targets, placements or {}, mine, threads)
        finally:
            files.close()
    else:
        loaded = _load_fresh(files, comm, names, placements or {}, mine, threads, mmap and storage.mappable)
    ts = TrainingState.from_dict(meta.training_state) if meta.training_state is not None else None
    return LoadedCheckpoint(name, loaded, ts, meta.user_metadata, meta.world_size, meta)


def _raise_collected(comm: Comm, problems: List[str], error: Optional[str]) -> None:
    """Exchange problems so every rank fails the same way (and none waits in a later collective)."""
    everything = comm.all_gather({"problems": problems, "error": error})
    for res in everything:
        if res["problems"]:
            raise CheckpointError(f"{res['problems'][0]}; load another checkpoint (or pass verify=False at your risk)")
    for res in everything:
        if res["error"]:
            raise CheckpointError(res["error"])


def _unflatten(files: ShardFiles, get: Any) -> Any:
    try:
        return unflatten(files.meta.tree, get)
    except RecursionError:
        raise CheckpointError(f"checkpoint {files.name!r}: its state dict structure is nested too deeply") from None


def _load_fresh(files: ShardFiles, comm: Comm, names: Sequence[str], placements: Mapping[str, Placement],
                mine: Sequence[str], threads: int, use_mmap: bool) -> Any:
    """Fresh tensors: memory maps of the files where possible, each rank hashing its 1/N."""
    problems: List[str] = []
    error: Optional[str] = None
    tensors: Dict[str, torch.Tensor] = {}
    try:
        tensors, problems = load_tensors(files, names, comm.rank, comm.world_size, placements, {}, mine, threads,
                                         use_mmap=use_mmap)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - an I/O error on one rank must not leave the others waiting
        error = f"cannot read checkpoint {files.name!r}: {describe(err)}"
    finally:
        files.close()
    _raise_collected(comm, problems, error)
    return _unflatten(files, lambda n: tensors.get(n))


def _load_in_place(files: ShardFiles, comm: Comm, state_dict: Dict[str, Any], targets: Mapping[str, torch.Tensor],
                   placements: Mapping[str, Placement], mine: Sequence[str], threads: int) -> Any:
    """Verify before write (see :mod:`elasticrun.checkpoint.load_into`): the dry pass on every rank
    (headers, sizes, this rank's checksums, shapes), the exchange, then direct reads."""
    problems: List[str] = []
    error: Optional[str] = None
    regions: Dict[str, Region] = {}
    direct: Dict[str, List[Piece]] = {}
    bounce: List[str] = []
    try:
        regions = plan_regions(files.meta, list(targets), placements, comm.rank, comm.world_size)
        shapes = _unflatten(files, lambda n: torch.empty(regions[n][1], device="meta") if n in regions else None)
        check_fits(state_dict, shapes)  # every shape and key first: all tensors are filled, or none
        direct, bounce = plan_pieces(files, list(targets), regions, targets)
        checked = set(mine)
        order = file_order(list(files.meta.files), comm.rank, comm.world_size, set(direct) | checked)

        def dry(f: str) -> Optional[str]:
            return check_file(files, f, direct.get(f, []), f in checked)

        problems = [p for p in _parallel(dry, order, threads) if p]
    except RecursionError:
        error = f"checkpoint {files.name!r}: its state dict structure is nested too deeply"
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - an I/O error on one rank must not leave the others waiting
        error = f"cannot read checkpoint {files.name!r}: {describe(err)}"
    _raise_collected(comm, problems, error)
    try:
        with torch.no_grad():
            _parallel(lambda f: fill_file(files, direct[f]),
                      file_order(list(files.meta.files), comm.rank, comm.world_size, direct), threads)
            for n in bounce:
                fill_bounced(files, n, regions[n][0], regions[n][1], targets[n])
    except Exception as err:  # noqa: BLE001 - one clear line (the files changed under us, or an I/O error)
        why = str(err) if isinstance(err, CheckpointError) else describe(err)
        raise CheckpointError(f"cannot read checkpoint {files.name!r} after every check passed (the state dict "
                              f"may be partly loaded): {why}") from None
    return fill_in_place(state_dict, _unflatten(files, lambda n: targets.get(n)))


def _parallel(fn: Any, items: Sequence[str], threads: int) -> List[Any]:
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="ckpt-read") as pool:
        return list(pool.map(fn, items))
