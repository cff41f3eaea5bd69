"""Which bytes of which shard file fill which part of a tensor, and reading them.

A rank wants a *region* of every tensor (a box of the global tensor): the whole tensor
if replicated, or its even part along ``dim`` if sharded — ``torch.tensor_split``
semantics, so with ``n`` rows over ``M`` ranks the first ``n % M`` ranks get one extra
row. :func:`region_pieces` intersects the region with the saved chunks; :func:`read_piece`
reads one intersection with ``pread`` straight into the destination when its bytes are
contiguous (one spanning read plus a strided copy otherwise).
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Sequence, Tuple

import torch

from elasticrun.checkpoint.format import DTYPES, CheckpointMeta, Chunk, Placement, Shard, TensorEntry
from elasticrun.checkpoint.plan import numel, split_bounds
from elasticrun.checkpoint.shardfile import read_header
from elasticrun.checkpoint.staging import byte_view, readinto_exact
from elasticrun.checkpoint.storage import LocalStorage, Storage, retry
from elasticrun.errors import CheckpointError


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
            if isinstance(self.storage, LocalStorage) and not os.path.isfile(path) and os.path.exists(path):
                raise CheckpointError(f"{where} is not a regular file: the checkpoint is corrupt")
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


def header_entry(files: ShardFiles, entry: TensorEntry, chunk: Chunk) -> Tuple[IO[bytes], int, str]:
    """The open file, the absolute offset of the chunk's data, and a display name; checks the header."""
    f, header, data_start = files.get(chunk.file)
    h = header.get(chunk.key)
    where = files.where(chunk.file)
    # read_header checked every entry (offsets inside the data section, matching its shape).
    if (not isinstance(h, dict) or h.get("dtype") != entry.dtype or tuple(h.get("shape", ())) != chunk.shape
            or h["data_offsets"][1] - h["data_offsets"][0] != numel(chunk.shape) * DTYPES[entry.dtype][1]):
        raise CheckpointError(f"{where}: tensor {chunk.key!r} does not match metadata.json: the file is corrupt")
    return f, data_start + h["data_offsets"][0], where


def piece_span(files: ShardFiles, piece: Piece) -> Tuple[IO[bytes], int, int, str]:
    """``(file, offset, span in elements, display name)``: the one byte range of the file that
    holds ``piece`` (exactly its bytes when ``span == piece.dst.numel()``)."""
    f, chunk_off, where = header_entry(files, piece.entry, piece.chunk)
    itemsize = DTYPES[piece.entry.dtype][1]
    strides = _strides(piece.chunk.shape)
    src = [lo - c for lo, c in zip(piece.lo, piece.chunk.offsets)]
    first = sum(s * st for s, st in zip(src, strides))
    last = sum((s + h - lo - 1) * st for s, lo, h, st in zip(src, piece.lo, piece.hi, strides))
    return f, chunk_off + first * itemsize, last - first + 1, where


def read_piece(files: ShardFiles, piece: Piece) -> None:
    """Fill ``piece.dst`` (a CPU tensor) from its chunk: straight into it when the bytes are
    contiguous, otherwise one spanning read plus a strided copy."""
    f, offset, span, where = piece_span(files, piece)
    if span == piece.dst.numel() and piece.dst.is_contiguous():
        readinto_exact(f, offset, byte_view(piece.dst), where)
    else:
        itemsize = DTYPES[piece.entry.dtype][1]
        inter = [h - lo for lo, h in zip(piece.lo, piece.hi)]
        buf = torch.empty(span * itemsize, dtype=torch.uint8)
        readinto_exact(f, offset, byte_view(buf), where)
        piece.dst.copy_(buf.view(piece.dst.dtype).as_strided(inter, _strides(piece.chunk.shape), 0))


def read_region(files: ShardFiles, entry: TensorEntry, offsets: Sequence[int], out: torch.Tensor) -> None:
    """Fill ``out`` (shape = the region) with the box of ``entry`` starting at ``offsets``."""
    for piece in region_pieces(entry, offsets, out):
        read_piece(files, piece)
