"""Who writes what: the global save plan computed identically on every rank.

Every rank contributes the names, dtypes, local shapes and placements of its tensors
(one small ``all_gather``). From that, each rank derives the same plan:

* ``Shard(dim)`` tensors: each rank writes its own slice; global shape and offsets come
  from the gathered local shapes (slices may be uneven).
* ``Replicate`` tensors: written once, every rank writing about 1/N of the bytes. If
  assigning them whole (largest first, to the least-loaded rank) balances the ranks within
  ``BALANCE``, that is the plan: a whole tensor is one chunk, which a loader can map
  straight from the file. Otherwise large ones (>= ``SPLIT_BYTES`` with at least as many
  rows as ranks) are split along dim 0 so rank ``i`` writes rows part ``i``
  (``torch.tensor_split`` boundaries) and the rest go whole, largest first.

A rank with spare cores writes its bytes as several files at once (``parts``), each with
its own sha256 — which is what lets hashing use more than one core. Its items go whole
into the files when that balances them within ``BALANCE``; otherwise the items, in name
order, are cut into contiguous runs of about equal size at row boundaries (so a large
tensor may become a few chunks in different files).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from elasticrun.checkpoint.format import DTYPES, Chunk, Placement, Replicate, Shard, TensorEntry, shard_file_name
from elasticrun.errors import CheckpointError

SPLIT_BYTES = 4 << 20
#: A rank writes one more file (in parallel) per this many bytes, up to its thread count.
MIN_PART_BYTES = 64 << 20
#: Whole-tensor assignment is kept when the fullest rank/file holds at most this much more
#: than an even share (or less than ``BALANCE_SLACK`` bytes more, for small states).
BALANCE = 1.125
BALANCE_SLACK = 1 << 20

# (name, dtype code, local shape, placement) as gathered from one rank
LocalInfo = Tuple[str, str, Tuple[int, ...], Placement]


@dataclass(frozen=True)
class WriteItem:
    """One chunk a rank writes: ``rows`` is a dim-0 range of its local tensor, or None for all of it."""

    name: str
    chunk: Chunk
    rows: Optional[Tuple[int, int]]


@dataclass
class SavePlan:
    tensors: Dict[str, TensorEntry]
    writes: List[List[WriteItem]]  # per rank, in file order

    def item_bytes(self, item: WriteItem) -> int:
        return numel(item.chunk.shape) * DTYPES[self.tensors[item.name].dtype][1]

    def bytes_per_rank(self) -> List[int]:
        return [sum(self.item_bytes(i) for i in items) for items in self.writes]

    def files_of(self, rank: int) -> List[Tuple[str, List[WriteItem]]]:
        """The files ``rank`` writes, each with its items in file order (a rank with nothing to
        write still writes one empty file: every rank has at least one)."""
        out: Dict[str, List[WriteItem]] = {}
        for item in self.writes[rank]:
            out.setdefault(item.chunk.file, []).append(item)
        return list(out.items()) or [(shard_file_name(rank, len(self.writes)), [])]


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a 0-d tensor)."""
    n = 1
    for s in shape:
        n *= s
    return n


def split_bounds(n: int, parts: int) -> List[Tuple[int, int]]:
    """``torch.tensor_split`` boundaries: the first ``n % parts`` pieces get one extra row."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _check_consistent(per_rank: Sequence[Sequence[LocalInfo]]) -> Dict[str, List[LocalInfo]]:
    """Index gathered infos by name; every rank must hold the same tensors with the same dtype/placement."""
    by_name: Dict[str, List[LocalInfo]] = {}
    names0 = [i[0] for i in per_rank[0]]
    for rank, infos in enumerate(per_rank):
        names = [i[0] for i in infos]
        if sorted(names) != sorted(names0):
            missing = sorted(set(names0) - set(names))[:3]
            extra = sorted(set(names) - set(names0))[:3]
            raise CheckpointError(
                f"rank {rank} saves different tensors than rank 0 (missing {missing}, extra {extra}): every rank "
                "must pass a state dict with the same keys"
            )
        for info in infos:
            by_name.setdefault(info[0], []).append(info)
    for name, infos in by_name.items():
        if name == "__metadata__":
            raise CheckpointError("'__metadata__' is reserved by safetensors: rename that state dict key")
        first = infos[0]
        for rank, info in enumerate(infos):
            if info[1] != first[1] or info[3] != first[3]:
                raise CheckpointError(
                    f"tensor {name!r} differs between ranks: rank 0 has {first[1]} {first[3]}, rank {rank} has "
                    f"{info[1]} {info[3]}"
                )
    return by_name


def _shard_entry(name: str, infos: List[LocalInfo], dim: int, writes: List[List[WriteItem]],
                 loads: List[int]) -> TensorEntry:
    shapes = [i[2] for i in infos]
    ndim = len(shapes[0])
    if not 0 <= dim < ndim:
        raise CheckpointError(f"tensor {name!r} is Shard({dim}) but has {ndim} dimensions")
    for rank, s in enumerate(shapes):
        if len(s) != ndim or any(s[d] != shapes[0][d] for d in range(ndim) if d != dim):
            raise CheckpointError(
                f"tensor {name!r} is Shard({dim}) but rank {rank}'s slice {tuple(s)} does not match rank 0's "
                f"{tuple(shapes[0])} outside dim {dim}"
            )
    chunks = []
    offset = 0
    itemsize = DTYPES[infos[0][1]][1]
    for rank, s in enumerate(shapes):
        offsets = tuple(offset if d == dim else 0 for d in range(ndim))
        chunk = Chunk(shard_file_name(rank, len(infos)), name, offsets, tuple(s))
        chunks.append(chunk)
        writes[rank].append(WriteItem(name, chunk, None))
        loads[rank] += numel(s) * itemsize
        offset += s[dim]
    global_shape = tuple(offset if d == dim else shapes[0][d] for d in range(ndim))
    return TensorEntry(name, infos[0][1], global_shape, Shard(dim), tuple(chunks))


def make_plan(per_rank: Sequence[Sequence[LocalInfo]], threads: Optional[Sequence[int]] = None) -> SavePlan:
    """The global plan from every rank's local infos (deterministic: same input, same plan).

    ``threads[r]`` is how many files rank ``r`` may write in parallel (default 1)."""
    world = len(per_rank)
    by_name = _check_consistent(per_rank)
    writes: List[List[WriteItem]] = [[] for _ in range(world)]
    loads = [0] * world
    tensors: Dict[str, TensorEntry] = {}
    replicated: List[Tuple[int, str]] = []
    for name, infos in by_name.items():
        placement = infos[0][3]
        if isinstance(placement, Shard):
            tensors[name] = _shard_entry(name, infos, placement.dim, writes, loads)
            continue
        shape = infos[0][2]
        for rank, info in enumerate(infos):
            if info[2] != shape:
                raise CheckpointError(
                    f"tensor {name!r} is replicated but rank {rank} has shape {tuple(info[2])} and rank 0 "
                    f"{tuple(shape)}: declare it Shard(dim) in placements if each rank holds a slice"
                )
        replicated.append((numel(shape) * DTYPES[infos[0][1]][1], name))

    # Whole tensors (assigned below, largest first) if that balances the ranks; else split the large ones.
    whole = _balanced_whole([n for n, _ in sorted(replicated, key=lambda x: (-x[0], x[1]))], loads) is not None
    small: List[Tuple[int, str]] = []
    for nbytes, name in replicated:
        shape = by_name[name][0][2]
        dtype = by_name[name][0][1]
        if not whole and world > 1 and nbytes >= SPLIT_BYTES and len(shape) >= 1 and shape[0] >= world:
            chunks = []
            for rank, (a, b) in enumerate(split_bounds(shape[0], world)):
                chunk = Chunk(shard_file_name(rank, world), name, (a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:])
                chunks.append(chunk)
                writes[rank].append(WriteItem(name, chunk, (a, b)))
                loads[rank] += nbytes * (b - a) // shape[0]
            tensors[name] = TensorEntry(name, dtype, shape, Replicate(), tuple(chunks))
        else:
            small.append((nbytes, name))
    for nbytes, name in sorted(small, key=lambda x: (-x[0], x[1])):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shape = by_name[name][0][2]
        chunk = Chunk(shard_file_name(rank, world), name, (0,) * len(shape), shape)
        writes[rank].append(WriteItem(name, chunk, None))
        loads[rank] += nbytes
        tensors[name] = TensorEntry(name, by_name[name][0][1], shape, Replicate(), (chunk,))
    # Write in name order within each file: stable, readable, and deterministic.
    for items in writes:
        items.sort(key=lambda i: i.name)
    plan = SavePlan({n: tensors[n] for n in by_name}, writes)
    if threads is not None and any(t > 1 for t in threads):
        plan = _split_into_parts(plan, threads)
    return plan


def _balanced_whole(sizes: Sequence[int], loads: Sequence[int], slack: int = BALANCE_SLACK) -> Optional[List[int]]:
    """Bins (largest first, least-loaded first) for items of ``sizes`` on top of ``loads``, or
    None when the fullest bin would exceed an even share by more than ``BALANCE`` and ``slack``."""
    bins = list(loads)
    where = []
    for size in sizes:
        b = min(range(len(bins)), key=lambda i: (bins[i], i))
        bins[b] += size
        where.append(b)
    ideal = sum(bins) / len(bins)
    worst = max(bins)
    return where if worst <= ideal * BALANCE or worst - ideal <= slack else None


def _split_into_parts(plan: SavePlan, threads: Sequence[int]) -> SavePlan:
    """Spread each rank's items over up to ``threads[rank]`` files of about equal size."""
    world = len(plan.writes)
    writes: List[List[WriteItem]] = []
    for rank, items in enumerate(plan.writes):
        total = sum(plan.item_bytes(i) for i in items)
        parts = max(1, min(threads[rank], total // MIN_PART_BYTES))
        runs = _runs(plan, items, total, parts) if parts > 1 else [items]
        runs = [run for run in runs if run]
        writes.append([replace(i, chunk=replace(i.chunk, file=shard_file_name(rank, world, p, len(runs))))
                       for p, run in enumerate(runs) for i in run])
    chunks: Dict[str, List[Chunk]] = {}
    for items in writes:
        for i in items:
            chunks.setdefault(i.name, []).append(i.chunk)
    tensors = {n: replace(t, chunks=tuple(chunks[n])) for n, t in plan.tensors.items()}
    return SavePlan(tensors, writes)


def _runs(plan: SavePlan, items: Sequence[WriteItem], total: int, parts: int) -> List[List[WriteItem]]:
    """``parts`` groups of whole items if they balance, else :func:`_cut`; name order inside each."""
    order = sorted(items, key=lambda i: (-plan.item_bytes(i), i.name))
    where = _balanced_whole([plan.item_bytes(i) for i in order], [0] * parts, slack=0)
    if where is None:
        return _cut(plan, items, total, parts)
    runs: List[List[WriteItem]] = [[] for _ in range(parts)]
    for item, b in zip(order, where):
        runs[b].append(item)
    return [sorted(run, key=lambda i: i.name) for run in runs]


def _cut(plan: SavePlan, items: Sequence[WriteItem], total: int, parts: int) -> List[List[WriteItem]]:
    """Cut the byte stream of ``items`` into ``parts`` runs of about ``total / parts`` bytes.

    A boundary inside a tensor splits it along dim 0 at the nearest row; a tensor with
    fewer than two rows is not split and goes to the run holding most of its bytes."""
    runs: List[List[WriteItem]] = [[] for _ in range(parts)]
    bounds = [total * p // parts for p in range(1, parts)]
    start, part = 0, 0
    for item in items:
        nbytes = plan.item_bytes(item)
        rows = item.chunk.shape[0] if item.chunk.shape else 0
        units = rows if rows >= 2 else 1  # what can be cut: rows, or the whole tensor
        done = 0
        while part < parts - 1 and bounds[part] < start + nbytes:
            cut = min(units, max(done, round((bounds[part] - start) * units / nbytes)))
            if cut > done:
                runs[part].append(_units_of(item, done, cut, units))
            done = cut
            part += 1
        if done < units:
            runs[part].append(_units_of(item, done, units, units))
        start += nbytes
    return runs


def _units_of(item: WriteItem, a: int, b: int, units: int) -> WriteItem:
    """The part of ``item`` holding its chunk rows ``a:b`` (the item itself when that is all of it)."""
    if (a, b) == (0, units):
        return item
    base = item.rows[0] if item.rows is not None else 0
    c = item.chunk
    chunk = replace(c, offsets=(c.offsets[0] + a,) + c.offsets[1:], shape=(b - a,) + c.shape[1:])
    return WriteItem(item.name, chunk, (base + a, base + b))
