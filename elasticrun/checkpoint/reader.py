"""``load()`` at any world size: each rank reads only the byte ranges it needs.

For every tensor the rank wants a *region* (a box of the global tensor): the whole
tensor if replicated, or its even part along ``dim`` if sharded — ``torch.tensor_split``
semantics, so with ``n`` rows over ``M`` ranks the first ``n % M`` ranks get one extra
row. :func:`read_region` intersects the region with the saved chunks and reads each
intersection with ``pread`` straight into the destination tensor when the bytes are
contiguous (one spanning read plus a strided copy otherwise). File checksums are checked
in parallel with the reads, files split across ranks; a mismatch names the file.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import DTYPES, LATEST, CheckpointMeta, Chunk, Placement, Shard, TensorEntry
from elasticrun.checkpoint.plan import split_bounds
from elasticrun.checkpoint.shardfile import PIECE, Hasher, byte_view, read_header, readinto_exact, torch_dtype
from elasticrun.checkpoint.storage import Storage, default_io_threads, describe, get_storage, retry
from elasticrun.checkpoint.tree import fill_in_place, flatten, unflatten
from elasticrun.checkpoint.validate import meta_path, read_meta_bytes, resolve_name, verify_file
from elasticrun.errors import CheckpointError
from elasticrun.models import TrainingState


@dataclass
class LoadedCheckpoint:
    """What ``load`` returns: the state dict (this rank's view) and the checkpoint's metadata."""

    name: str
    state_dict: Dict[str, Any]
    training_state: Optional[TrainingState]
    user_metadata: Dict[str, Any]
    world_size: int  # the world size that saved it
    meta: CheckpointMeta


class ShardFiles:
    """Open shard files of one checkpoint, with their parsed safetensors headers."""

    def __init__(self, storage: Storage, name: str, meta: CheckpointMeta) -> None:
        self.storage, self.name, self.meta = storage, name, meta
        self._open: Dict[str, Tuple[IO[bytes], Dict[str, Any], int]] = {}
        self._lock = threading.Lock()

    def where(self, fname: str) -> str:
        """How to name ``fname`` in an error message."""
        return self.storage.display(f"{self.storage.join(self.name)}/{fname}")

    def get(self, fname: str) -> Tuple[IO[bytes], Dict[str, Any], int]:
        """The open file, its parsed header and the offset of its data section (thread-safe)."""
        with self._lock:
            return self._get(fname)

    def _get(self, fname: str) -> Tuple[IO[bytes], Dict[str, Any], int]:
        if fname not in self._open:
            path = f"{self.storage.join(self.name)}/{fname}"
            where = self.storage.display(path)
            f = retry(lambda: self.storage.open_read(path), f"open {where}")
            try:
                header, start = read_header(f, where, self.meta.files[fname].size)
            except BaseException:
                f.close()
                raise
            self._open[fname] = (f, header, start)
        return self._open[fname]

    def mapping(self, fname: str) -> mmap.mmap:
        """A private (copy-on-write) memory map of the whole file; tensors made from it keep it alive."""
        f, _, _ = self.get(fname)
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hasattr(mmap, "MADV_WILLNEED"):
            mm.madvise(mmap.MADV_WILLNEED)  # start reading it all in now, in the background
        return mm

    def close(self) -> None:
        for f, _, _ in self._open.values():
            f.close()
        self._open.clear()


def _strides(shape: Sequence[int]) -> List[int]:
    out, acc = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = acc
        acc *= shape[i]
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def region_for(entry: TensorEntry, placement: Placement, rank: int, world: int) -> Tuple[List[int], List[int]]:
    """``(offsets, shape)`` of the part of ``entry`` that ``rank`` of ``world`` gets."""
    shape = list(entry.shape)
    offsets = [0] * len(shape)
    if isinstance(placement, Shard) and world > 1:
        if not 0 <= placement.dim < len(shape):
            raise CheckpointError(f"cannot shard {entry.name!r} along dim {placement.dim}: it has {len(shape)} dims")
        a, b = split_bounds(shape[placement.dim], world)[rank]
        offsets[placement.dim], shape[placement.dim] = a, b - a
    return offsets, shape


@dataclass
class Piece:
    """The part of one saved chunk that falls inside a wanted region, and where it goes."""

    entry: TensorEntry
    chunk: Chunk
    lo: List[int]  # global coordinates of the intersection
    hi: List[int]
    dst: torch.Tensor  # the view of the destination tensor it fills

    @property
    def whole(self) -> bool:
        """The whole chunk lands in one contiguous view (so its bytes are one plain read)."""
        return list(self.dst.shape) == list(self.chunk.shape) and self.dst.is_contiguous()


def region_pieces(entry: TensorEntry, offsets: Sequence[int], out: torch.Tensor) -> List[Piece]:
    """The pieces that fill ``out`` (the box of ``entry`` at ``offsets``); a CheckpointError if the
    saved chunks do not cover it."""
    shape = tuple(out.shape)
    pieces, covered = [], 0
    for chunk in entry.chunks:
        lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
        hi = [min(o + s, c + cs) for o, s, c, cs in zip(offsets, shape, chunk.offsets, chunk.shape)]
        if any(h - lo_ <= 0 for lo_, h in zip(lo, hi)):
            continue
        dst = out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
        pieces.append(Piece(entry, chunk, lo, hi, dst))
        covered += dst.numel()
    if covered != out.numel():
        raise CheckpointError(f"the saved chunks of {entry.name!r} do not cover the tensor: the checkpoint is corrupt")
    return pieces


def _header_entry(files: ShardFiles, entry: TensorEntry, chunk: Chunk) -> Tuple[IO[bytes], int, str]:
    """The open file, the absolute offset of the chunk's data, and a display name; checks the header."""
    f, header, data_start = files.get(chunk.file)
    h = header.get(chunk.key)
    where = files.where(chunk.file)
    if (not isinstance(h, dict) or h.get("dtype") != entry.dtype or tuple(h.get("shape", ())) != chunk.shape
            or h["data_offsets"][1] - h["data_offsets"][0] != _numel(chunk.shape) * DTYPES[entry.dtype][1]):
        raise CheckpointError(f"{where}: tensor {chunk.key!r} does not match metadata.json: the file is corrupt")
    return f, data_start + h["data_offsets"][0], where


def read_piece(files: ShardFiles, piece: Piece) -> None:
    """Fill ``piece.dst`` from its chunk: straight into it when the bytes are contiguous,
    otherwise one spanning read plus a strided copy."""
    f, chunk_off, where = _header_entry(files, piece.entry, piece.chunk)
    chunk = piece.chunk
    itemsize = DTYPES[piece.entry.dtype][1]
    strides = _strides(chunk.shape)
    inter = [h - lo for lo, h in zip(piece.lo, piece.hi)]
    src = [lo - c for lo, c in zip(piece.lo, chunk.offsets)]
    first = sum(s * st for s, st in zip(src, strides))
    last = sum((s + n - 1) * st for s, n, st in zip(src, inter, strides))
    span = last - first + 1
    if span == piece.dst.numel() and piece.dst.is_contiguous():
        readinto_exact(f, chunk_off + first * itemsize, byte_view(piece.dst), where)
    else:
        buf = torch.empty(span * itemsize, dtype=torch.uint8)
        readinto_exact(f, chunk_off + first * itemsize, byte_view(buf), where)
        piece.dst.copy_(buf.view(piece.dst.dtype).as_strided(inter, strides, 0))


def read_region(files: ShardFiles, entry: TensorEntry, offsets: Sequence[int], out: torch.Tensor) -> None:
    """Fill ``out`` (shape = the region) with the box of ``entry`` starting at ``offsets``."""
    for piece in region_pieces(entry, offsets, out):
        read_piece(files, piece)


def _read_and_hash(files: ShardFiles, fname: str, pieces: List[Piece], pool: ThreadPoolExecutor) -> Optional[str]:
    """Read a file this rank needs in full front to back, hashing the bytes as they land in the
    destination tensors (one pass over the disk for data and checksum); the problem or None."""
    f, header, start = files.get(fname)
    where = files.where(fname)
    hasher = Hasher(pool)
    head = bytearray(start)
    readinto_exact(f, 0, memoryview(head), where)
    hasher.update(memoryview(head))
    pos = start
    for piece in sorted(pieces, key=lambda p: header.get(p.chunk.key, {}).get("data_offsets", [0])[0]):
        _, off, _ = _header_entry(files, piece.entry, piece.chunk)
        if off != pos:
            raise CheckpointError(f"{where}: tensor {piece.chunk.key!r} is not where metadata.json expects it")
        data = byte_view(piece.dst)
        for a in range(0, len(data), PIECE):  # piece by piece, so hashing overlaps the next read
            readinto_exact(f, pos + a, data[a:a + PIECE], where)
            hasher.update(data[a:a + PIECE])
        pos += len(data)
    expected = files.meta.files[fname]
    if pos != expected.size:
        return f"file {fname} of checkpoint {files.name!r} has data beyond its tensors: corrupt"
    if hasher.hexdigest() != expected.sha256:
        return f"file {fname} of checkpoint {files.name!r} is corrupt: its sha256 does not match metadata.json"
    return None


def _map_tensor(files: ShardFiles, mm: mmap.mmap, entry: TensorEntry, chunk: Chunk) -> Optional[torch.Tensor]:
    """``chunk`` (the whole tensor) as a view of the file's memory map, or None when its bytes
    are not aligned for its dtype (safetensors packs tensors without padding)."""
    f, off, where = _header_entry(files, entry, chunk)
    itemsize = DTYPES[entry.dtype][1]
    numel = _numel(chunk.shape)
    if numel == 0 or off % itemsize:
        return None
    if off + numel * itemsize > len(mm):
        raise CheckpointError(f"{where} is truncated: tensor {chunk.key!r} runs past its end")
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=numel * itemsize, offset=off)
    return flat.view(torch_dtype(entry.dtype)).view(chunk.shape)


def _hash_mapping(mm: mmap.mmap) -> str:
    h = hashlib.sha256()
    with memoryview(mm) as view:
        for a in range(0, len(view), PIECE):
            h.update(view[a:a + PIECE])
    return h.hexdigest()


def _file_task(files: ShardFiles, fname: str, pieces: List[Piece], mapped: List[Tuple[TensorEntry, Chunk]],
               verify: bool) -> Tuple[Optional[str], Dict[str, torch.Tensor]]:
    """Everything this rank does with one file: map or read its pieces, check its sha256 if asked.
    Returns the problem (or None) and the tensors it made (mapped ones, or copies where unaligned)."""
    made: Dict[str, torch.Tensor] = {}
    n_chunks = sum(1 for t in files.meta.tensors.values() for c in t.chunks if c.file == fname)
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
                if len(mm) != expected.size:
                    return (f"file {fname} of checkpoint {files.name!r} has {len(mm)} bytes, metadata says "
                            f"{expected.size} (truncated?)"), made
                if _hash_mapping(mm) != expected.sha256:
                    return (f"file {fname} of checkpoint {files.name!r} is corrupt: its sha256 does not match "
                            "metadata.json"), made
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


def load_tensors(files: ShardFiles, names: Sequence[str], rank: int, world: int,
                 placements: Mapping[str, Placement], targets: Mapping[str, torch.Tensor],
                 verify: Sequence[str] = (), threads: int = 1,
                 use_mmap: bool = False) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Read this rank's region of every named tensor, into ``targets`` where they fit exactly.

    Files are handled by up to ``threads`` threads, one file each; the files in ``verify`` get
    their sha256 checked (while reading them, when this rank needs them whole). With
    ``use_mmap``, a tensor without a target that is exactly one saved chunk becomes a
    copy-on-write view of the file's memory map instead of a copy.
    Returns the tensors and the checksum problems found."""
    out: Dict[str, torch.Tensor] = {}
    by_file: Dict[str, List[Piece]] = {}
    mapped: Dict[str, List[Tuple[TensorEntry, Chunk]]] = {}
    for name in names:
        entry = files.meta.tensors[name]
        offsets, shape = region_for(entry, placements.get(name, entry.placement), rank, world)
        dtype = torch_dtype(entry.dtype)
        t = targets.get(name)
        if not (t is not None and t.device.type == "cpu" and t.dtype == dtype and list(t.shape) == shape
                and t.is_contiguous()):
            whole = [c for c in entry.chunks if list(c.offsets) == offsets and list(c.shape) == shape]
            if use_mmap and whole:  # one saved chunk is exactly what we want: map it (no copy)
                mapped.setdefault(whole[0].file, []).append((entry, whole[0]))
                continue
            t = torch.empty(shape, dtype=dtype)
        out[name] = t
        for piece in region_pieces(entry, offsets, t.detach()):
            by_file.setdefault(piece.chunk.file, []).append(piece)
    # Start where this rank's share of the files starts, so ranks read different files first
    # (each cold file comes off the disk once; the others find it in the page cache).
    every = sorted(files.meta.files)
    k = rank * len(every) // world
    checked = set(verify)
    order = [f for f in every[k:] + every[:k] if f in by_file or f in mapped or f in checked]

    def task(f: str) -> Tuple[Optional[str], Dict[str, torch.Tensor]]:
        return _file_task(files, f, by_file.get(f, []), mapped.get(f, []), f in checked)

    with torch.no_grad():
        if threads <= 1 or len(order) <= 1:
            results = [task(f) for f in order]
        else:
            with ThreadPoolExecutor(min(threads, len(order)), thread_name_prefix="ckpt-read") as pool:
                results = list(pool.map(task, order))
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
    returned as ``.state_dict``. ``verify=False`` skips the sha256 check of the files.
    ``io_threads`` files are read (and hashed) at once (default: this rank's share of the CPUs).

    Tensors loaded fresh (not into ``state_dict``) that were saved whole are, on a local
    filesystem, private copy-on-write memory maps of their files — like
    ``safetensors.load_file`` or ``torch.load(mmap=True)``: no copy, pages shared by every
    rank on the node until written. ``mmap=False`` gives ordinary private memory.
    """
    comm = Comm(process_group)
    storage = get_storage(root, storage_options)
    head: Dict[str, Any] = {}
    if comm.rank == 0:
        try:
            resolved = resolve_name(storage, name)
            raw = read_meta_bytes(storage, resolved)
            CheckpointMeta.loads(raw, meta_path(storage, resolved))  # clear errors here, before the others parse it
            head = {"name": resolved, "meta": raw}
        except CheckpointError as err:
            head = {"error": str(err)}
    head = comm.broadcast(head)
    if "error" in head:
        raise CheckpointError(head["error"])
    name = head["name"]
    meta = CheckpointMeta.loads(head["meta"], meta_path(storage, name))

    targets: Dict[str, torch.Tensor] = {}
    if state_dict is not None:
        targets, _ = flatten(state_dict)
        missing = [n for n in targets if n not in meta.tensors]
        if missing:
            raise CheckpointError(f"checkpoint {name!r} has no tensor {missing[0]!r} (and {len(missing) - 1} more)"
                                  if len(missing) > 1 else f"checkpoint {name!r} has no tensor {missing[0]!r}")
    names = list(targets) if state_dict is not None else list(meta.tensors)

    files = ShardFiles(storage, name, meta)
    problems: List[str] = []
    error: Optional[str] = None
    tensors: Dict[str, torch.Tensor] = {}
    # Each rank checks the sha256 of its 1/N block of the files: while reading them if it reads
    # them whole (one pass), otherwise separately (from the page cache, usually).
    every, world = sorted(meta.files), comm.world_size
    mine = every[comm.rank * len(every) // world:(comm.rank + 1) * len(every) // world] if verify else []
    try:
        tensors, problems = load_tensors(files, names, comm.rank, world, placements or {}, targets, mine,
                                         io_threads or default_io_threads(), use_mmap=mmap and storage.mappable)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - an I/O error on one rank must not leave the others waiting
        error = f"cannot read checkpoint {name!r}: {describe(err)}"
    finally:
        files.close()
    # Exchange problems so every rank fails the same way (and none waits in a later collective).
    everything = comm.all_gather({"problems": problems, "error": error})
    for res in everything:
        if res["problems"]:
            raise CheckpointError(f"{res['problems'][0]}; load another checkpoint (or pass verify=False at your risk)")
    for res in everything:
        if res["error"]:
            raise CheckpointError(res["error"])

    loaded = unflatten(meta.tree, lambda n: tensors.get(n))
    if state_dict is not None:
        loaded = fill_in_place(state_dict, loaded)
    ts = TrainingState.from_dict(meta.training_state) if meta.training_state is not None else None
    return LoadedCheckpoint(name, loaded, ts, meta.user_metadata, meta.world_size, meta)
