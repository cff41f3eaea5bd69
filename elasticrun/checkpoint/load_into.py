"""Loads into the caller's tensors (``load(state_dict=...)``): every check first, then direct reads.

Verify before write without a staging copy. First a *dry* pass, which writes nothing into
the caller's tensors: every shard file this rank reads is opened and its header parsed and
matched against ``metadata.json``, every file's size is checked, and this rank's 1/N of the
files are hashed (their checksum, the reads overlapped with the hashing) — which also brings them
into the page cache. The problems of every rank are exchanged and the shapes checked
against the state dict; only when all of that passed are the bytes read straight into the
caller's tensors (``pread`` into CPU tensors; for CUDA tensors, into two reusable pinned
host buffers whose host-to-device copies run on a side stream, so the read of one chunk
overlaps the copy of the previous one). A failed check leaves the caller's tensors exactly
as they were; only an I/O error during the final reads (after every check passed) could
leave them partly written.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from elasticrun.checkpoint.checksum import Checksum, file_digest
from elasticrun.checkpoint.regions import Piece, ShardFiles, header_entry, piece_span, read_piece, region_pieces
from elasticrun.checkpoint.shardfile import torch_dtype
from elasticrun.checkpoint.staging import DeviceStager, readinto_exact
from elasticrun.checkpoint.storage import cpu_share, describe
from elasticrun.checkpoint.validate import checksum_mismatch, size_problem, verify_file
from elasticrun.errors import CheckpointError


def digest_file(f: Any, size: int, where: str, algo: Checksum) -> str:
    """The checksum of the first ``size`` bytes of ``f`` (reads overlapped with the hashing
    when a core is spare); a short file is a CheckpointError."""
    return file_digest(lambda off, view: readinto_exact(f, off, view, where), size, algo,
                       overlap=cpu_share() >= 2)


def check_file(files: ShardFiles, fname: str, pieces: Sequence[Piece], verify: bool) -> Optional[str]:
    """The dry pass for one file: header and sizes of what this rank reads, the checksum if asked.
    Returns the problem or None (a malformed header raises CheckpointError); writes nothing
    but the page cache."""
    expected = files.meta.files[fname]
    problem = size_problem(files.storage, files.name, expected)
    if problem:
        return problem
    where = files.where(fname)
    try:
        for piece in pieces:
            header_entry(files, piece.entry, piece.chunk)
        if verify:
            f, _, _ = files.get(fname)
            if digest_file(f, expected.size, where, expected.algo) != expected.digest:
                return checksum_mismatch(files.name, expected)
    except CheckpointError:
        # A file that cannot be parsed: if its checksum is wrong too, say that (the clearer cause).
        problem = verify_file(files.storage, files.name, expected) if verify else None
        if problem:
            return problem
        raise
    except OSError as err:
        return f"file {fname} of checkpoint {files.name!r} cannot be read: {describe(err)}"
    return None


def _fits(t: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> bool:
    return t.dtype == dtype and list(t.shape) == list(shape) and t.is_contiguous()


def plan_pieces(files: ShardFiles, names: Sequence[str], regions: Mapping[str, Tuple[List[int], List[int]]],
                targets: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, List[Piece]], List[str]]:
    """Pieces that go straight into the targets, by file, and the names of targets that need a
    CPU bounce (another dtype, or not contiguous): those get pieces into a scratch tensor later."""
    direct: Dict[str, List[Piece]] = {}
    bounce: List[str] = []
    for name in names:
        entry = files.meta.tensors[name]
        offsets, shape = regions[name]
        t = targets[name]
        if not _fits(t, torch_dtype(entry.dtype), shape) or t.device.type not in ("cpu", "cuda"):
            bounce.append(name)
            t = torch.empty(shape, dtype=torch_dtype(entry.dtype), device="meta")  # only for the piece plan
        for piece in region_pieces(entry, offsets, t.detach()):
            direct.setdefault(piece.chunk.file, []).append(piece)
    return direct, bounce


def fill_file(files: ShardFiles, pieces: Sequence[Piece]) -> None:
    """Read ``pieces`` (of one file) straight into their destination tensors: CPU ones with
    ``pread``, device ones through a :class:`DeviceStager` (small neighbours in one read)."""
    staged: Dict[torch.device, List[Tuple[int, torch.Tensor]]] = {}
    where = files.where(pieces[0].chunk.file) if pieces else ""
    f = None
    for piece in pieces:
        dst = piece.dst
        if dst.device.type == "meta":
            continue  # a bounced target: filled by fill_bounced
        if dst.device.type == "cpu":
            read_piece(files, piece)
            continue
        f, offset, span, where = piece_span(files, piece)
        if span == dst.numel() and dst.is_contiguous():
            staged.setdefault(dst.device, []).append((offset, dst.reshape(-1).view(torch.uint8)))
        else:  # strided on the device: a CPU scratch of the piece, then one copy
            scratch = torch.empty(tuple(dst.shape), dtype=dst.dtype)
            read_piece(files, Piece(piece.entry, piece.chunk, piece.lo, piece.hi, scratch))
            dst.copy_(scratch)
    for device, ranges in staged.items():
        stager = DeviceStager(device)
        try:
            stager.copy_many(f, ranges, where)
        finally:
            stager.finish()


def fill_bounced(files: ShardFiles, name: str, offsets: Sequence[int], shape: Sequence[int],
                 target: torch.Tensor) -> None:
    """A target of another dtype (or not contiguous): read into a CPU scratch, then ``copy_``."""
    entry = files.meta.tensors[name]
    scratch = torch.empty(list(shape), dtype=torch_dtype(entry.dtype))
    for piece in region_pieces(entry, offsets, scratch):
        read_piece(files, piece)
    target.copy_(scratch)
