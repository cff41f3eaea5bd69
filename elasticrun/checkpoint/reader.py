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

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import DTYPES, LATEST, CheckpointMeta, Placement, Shard, TensorEntry, chunks_by_file
from elasticrun.checkpoint.plan import split_bounds
from elasticrun.checkpoint.shardfile import Hasher, byte_view, read_header, readinto_exact, torch_dtype
from elasticrun.checkpoint.storage import Storage, get_storage, retry
from elasticrun.checkpoint.tree import fill_in_place, flatten, unflatten
from elasticrun.checkpoint.validate import meta_path, read_meta_bytes, resolve_name, verify_files
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

    def get(self, fname: str) -> Tuple[IO[bytes], Dict[str, Any], int]:
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


def read_region(files: ShardFiles, entry: TensorEntry, offsets: Sequence[int], out: torch.Tensor,
                skip: Optional[Set[Tuple[str, str]]] = None) -> None:
    """Fill ``out`` (shape = the region) with the box of ``entry`` starting at ``offsets``.

    Chunks whose ``(file, key)`` is in ``skip`` were already read (by :func:`read_whole_files`)."""
    shape = tuple(out.shape)
    itemsize = DTYPES[entry.dtype][1]
    covered = 0
    for chunk in entry.chunks:
        lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
        hi = [min(o + s, c + cs) for o, s, c, cs in zip(offsets, shape, chunk.offsets, chunk.shape)]
        inter = [h - lo_ for lo_, h in zip(lo, hi)]
        if any(n <= 0 for n in inter):
            continue
        if skip and (chunk.file, chunk.key) in skip:
            covered += _numel(inter)
            continue
        f, header, data_start = files.get(chunk.file)
        h = header.get(chunk.key)
        where = files.storage.display(f"{files.storage.join(files.name)}/{chunk.file}")
        if (not isinstance(h, dict) or h.get("dtype") != entry.dtype or tuple(h.get("shape", ())) != chunk.shape
                or h["data_offsets"][1] - h["data_offsets"][0] != _numel(chunk.shape) * itemsize):
            raise CheckpointError(f"{where}: tensor {chunk.key!r} does not match metadata.json: the file is corrupt")
        strides = _strides(chunk.shape)
        src = [lo_ - c for lo_, c in zip(lo, chunk.offsets)]
        first = sum(s * st for s, st in zip(src, strides))
        last = sum((s + n - 1) * st for s, n, st in zip(src, inter, strides))
        span = last - first + 1
        numel = _numel(inter)
        dst = out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
        file_off = data_start + h["data_offsets"][0] + first * itemsize
        if span == numel and dst.is_contiguous():
            readinto_exact(f, file_off, byte_view(dst), where)
        else:
            buf = torch.empty(span * itemsize, dtype=torch.uint8)
            readinto_exact(f, file_off, byte_view(buf), where)
            dst.copy_(buf.view(out.dtype).as_strided(inter, strides, 0))
        covered += numel
    if covered != out.numel():
        raise CheckpointError(f"checkpoint {files.name!r}: the chunks of {entry.name!r} do not cover the tensor")


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


def _whole_chunk_view(out: torch.Tensor, offsets: Sequence[int], chunk: Any) -> Optional[torch.Tensor]:
    """The contiguous view of ``out`` that holds all of ``chunk``, or None if there is none."""
    rel = [c - o for c, o in zip(chunk.offsets, offsets)]
    if any(r < 0 or r + cs > s for r, cs, s in zip(rel, chunk.shape, out.shape)):
        return None
    view = out[tuple(slice(r, r + cs) for r, cs in zip(rel, chunk.shape))]
    return view if view.is_contiguous() else None


def read_whole_files(files: ShardFiles, fnames: Sequence[str], wanted: Mapping[str, Tuple[List[int], torch.Tensor]],
                     problems: List[str], hashed: Set[str]) -> Set[Tuple[str, str]]:
    """Read files this rank needs in full front to back, hashing the bytes as they land in the
    destination tensors (one pass over the disk for data *and* checksum). Files it needs only
    in part are left to :func:`read_region` and hashed separately. Returns the chunks read."""
    by_file = chunks_by_file(files.meta)
    done: Set[Tuple[str, str]] = set()
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as pool:
        for fname in fnames:
            views = []
            for entry, chunk in by_file[fname]:
                view = None if entry.name not in wanted else _whole_chunk_view(*reversed(wanted[entry.name]), chunk)
                if view is None:
                    break
                views.append((chunk, view))
            else:
                f, header, start = files.get(fname)
                where = files.storage.display(f"{files.storage.join(files.name)}/{fname}")
                views.sort(key=lambda cv: header.get(cv[0].key, {}).get("data_offsets", [0])[0])
                hasher = Hasher(pool)
                head = bytearray(start)
                readinto_exact(f, 0, memoryview(head), where)
                hasher.update(memoryview(head))
                pos = start
                for chunk, view in views:
                    h = header.get(chunk.key)
                    if not isinstance(h, dict) or h.get("data_offsets", [None])[0] + start != pos:
                        raise CheckpointError(f"{where}: tensor {chunk.key!r} is not where metadata.json expects it")
                    data = byte_view(view)
                    readinto_exact(f, pos, data, where)
                    hasher.update(data)
                    pos += len(data)
                    done.add((fname, chunk.key))
                expected = files.meta.files[fname]
                hashed.add(fname)
                if pos != expected.size:
                    problems.append(f"file {fname} of checkpoint {files.name!r} has data beyond its tensors: corrupt")
                elif hasher.hexdigest() != expected.sha256:
                    problems.append(f"file {fname} of checkpoint {files.name!r} is corrupt: its sha256 does not "
                                    "match metadata.json")
    return done


def load_tensors(files: ShardFiles, names: Sequence[str], rank: int, world: int,
                 placements: Mapping[str, Placement], targets: Mapping[str, torch.Tensor],
                 verify: Sequence[str] = (), problems: Optional[List[str]] = None,
                 hashed: Optional[Set[str]] = None) -> Dict[str, torch.Tensor]:
    """Read this rank's region of every named tensor, into ``targets`` where they fit exactly.

    Files in ``verify`` that this rank reads completely are hashed on the fly: mismatches
    are appended to ``problems`` and the file names added to ``hashed``."""
    out: Dict[str, torch.Tensor] = {}
    wanted: Dict[str, Tuple[List[int], torch.Tensor]] = {}
    for name in names:
        entry = files.meta.tensors[name]
        offsets, shape = region_for(entry, placements.get(name, entry.placement), rank, world)
        dtype = torch_dtype(entry.dtype)
        t = targets.get(name)
        if not (t is not None and t.device.type == "cpu" and t.dtype == dtype and list(t.shape) == shape
                and t.is_contiguous()):
            t = torch.empty(shape, dtype=dtype)
        out[name] = t
        wanted[name] = (offsets, t.detach())
    with torch.no_grad():
        done = read_whole_files(files, verify, wanted, problems if problems is not None else [],
                                hashed if hashed is not None else set())
        for name, (offsets, t) in wanted.items():
            read_region(files, files.meta.tensors[name], offsets, t, skip=done)
    return out


def load(
    root: str,
    name: str = LATEST,
    *,
    state_dict: Optional[Dict[str, Any]] = None,
    placements: Optional[Mapping[str, Placement]] = None,
    process_group: Any = None,
    verify: bool = True,
    storage_options: Optional[Dict[str, Any]] = None,
) -> LoadedCheckpoint:
    """Load checkpoint ``name`` (default: the newest complete one) at this process's world size.

    Every rank of the group calls it. Tensors saved as ``Shard(dim)`` (or given ``Shard``
    in ``placements``) come back as this rank's even part along ``dim``
    (``torch.tensor_split`` boundaries); others come back whole. With ``state_dict`` the
    tensors are loaded into it in place (only the keys it has are read) and it is
    returned as ``.state_dict``. ``verify=False`` skips the sha256 check of the files.
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
    # Each rank checks the sha256 of about 1/N of the files: while reading them if it reads them
    # whole (one pass), otherwise afterwards (from the page cache, usually).
    mine = [f for i, f in enumerate(sorted(meta.files)) if i % comm.world_size == comm.rank] if verify else []
    hashed: Set[str] = set()
    try:
        tensors = load_tensors(files, names, comm.rank, comm.world_size, placements or {}, targets, mine, problems,
                               hashed)
    except CheckpointError as err:
        error = str(err)
    finally:
        files.close()
    problems += verify_files(storage, name, [meta.files[f] for f in mine if f not in hashed])
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
