"""One safetensors shard file: written with large sequential writes straight from tensor
memory (no serialisation copy), hashing the same bytes piece by piece (on a helper thread
when the caller has a core to spare), and read back by byte ranges into preallocated
tensors. On Linux the kernel is asked to start writing each piece to disk as soon as it is
written (``sync_file_range``), so the final fsync only waits for the tail.

The files are plain safetensors (8-byte little-endian header length, JSON header,
raw little-endian data), so ``safetensors.safe_open`` reads any of them.
"""

from __future__ import annotations

import ctypes
import functools
import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from elasticrun.checkpoint.checksum import DEFAULT_CHECKSUM, Checksum, Digest
from elasticrun.checkpoint.format import DTYPES
from elasticrun.checkpoint.staging import fileno_of, host_pieces
from elasticrun.errors import CheckpointError

PIECE = 64 << 20  # bytes per write() call; also the hashing granularity
MAX_HEADER = 256 << 20
WRITEBACK = 8 << 20  # least bytes per writeback request (a request per tiny tensor costs more than it gains)
# The dtype codes this torch has a dtype for (feature-detected, as safetensors.torch does).
_TORCH_DTYPES = {code: getattr(torch, tname) for code, (tname, _) in DTYPES.items() if hasattr(torch, tname)}
_DTYPE_CODE = {dtype: code for code, dtype in _TORCH_DTYPES.items()}


def dtype_code(dtype: torch.dtype, name: str) -> str:
    """safetensors code of a torch dtype, or CheckpointError naming the tensor."""
    try:
        return _DTYPE_CODE[dtype]
    except KeyError:
        raise CheckpointError(f"tensor {name!r} has dtype {dtype}, which elasticrun checkpoints cannot store "
                              "(see Limits in docs/checkpoints.md)") from None


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors code, or CheckpointError when this torch has none for it."""
    try:
        return _TORCH_DTYPES[code]
    except KeyError:
        raise CheckpointError(f"dtype {code} needs torch.{DTYPES[code][0]}, which torch {torch.__version__} does not "
                              "have: load the checkpoint with a newer torch") from None


def build_header(items: Sequence[Tuple[str, str, Sequence[int], int]], metadata: Dict[str, str]) -> bytes:
    """The header bytes (length prefix + JSON, space-padded to 8 bytes) for ``(key, dtype, shape, nbytes)``."""
    header: Dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, code, shape, nbytes in items:
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_all(f: IO[bytes], view: memoryview) -> None:
    while len(view):
        n = f.write(view)
        if n is None:  # a non-blocking raw file could not take anything; treat as transient
            raise BlockingIOError(11, "write would block")
        view = view[n:]


@functools.lru_cache(maxsize=1)
def _sync_file_range() -> Optional[Callable[[int, int, int, int], int]]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk, without
    waiting (Linux ``SYNC_FILE_RANGE_WRITE``); a no-op where that does not exist. Durability
    still comes from the fsync at the end of the file."""
    fn = _sync_file_range()
    if fn is not None and length > 0:
        fn(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; errors (EINVAL on odd filesystems) are harmless


class Hasher:
    """The checksum of a byte stream, computed on a helper thread when given a pool (zlib and
    hashlib release the GIL)."""

    def __init__(self, pool: Optional[ThreadPoolExecutor], algo: Checksum = DEFAULT_CHECKSUM) -> None:
        self._h = Digest(algo)
        self._pool = pool
        self._pending: List[Future] = []

    def update(self, data: memoryview) -> Optional[Future]:
        """Hash ``data`` next; returns the future of a deferred update (None when done here)."""
        self._pending = [f for f in self._pending if not f.done()]
        if self._pool is None or (len(data) < (1 << 20) and not self._pending):
            self._h.update(data)  # small and nothing queued: in order, right here
            return None
        fut = self._pool.submit(self._h.update, data)
        self._pending.append(fut)
        return fut

    def drain(self) -> None:
        """Wait until every byte handed to :meth:`update` is hashed (its buffer may be reused)."""
        for f in self._pending:
            f.result()
        self._pending = []

    def hexdigest(self) -> str:
        self.drain()
        return self._h.hexdigest()


def write_shard(
    f: IO[bytes],
    tensors: Sequence[Tuple[str, torch.Tensor]],
    metadata: Dict[str, str],
    pool: Optional[ThreadPoolExecutor],
    on_piece: Optional[Callable[[int], None]] = None,
    algo: Checksum = DEFAULT_CHECKSUM,
) -> Tuple[int, str]:
    """Write a safetensors file to ``f`` from contiguous tensors; returns ``(size, checksum)``
    (the hex digest of the whole file by ``algo``).

    CPU tensors are written straight from their memory; device (CUDA) tensors are staged
    through two reusable pinned buffers, their device-to-host copies overlapping the writes
    and the hashing (:func:`elasticrun.checkpoint.staging.host_pieces`).

    With a ``pool`` the hash runs there while the next piece is written (almost free with a
    spare core); without one each piece is hashed here before it is written.
    ``on_piece(bytes_written)`` is a test hook.
    """
    fd = fileno_of(f)
    items = [(k, dtype_code(t.dtype, k), tuple(t.shape), t.numel() * t.element_size()) for k, t in tensors]
    header = build_header(items, metadata)
    hasher = Hasher(pool, algo)
    hasher.update(memoryview(header))
    _write_all(f, memoryview(header))
    written = len(header)
    # Submitting writeback can block while the disk's queue is full: a flusher thread does it,
    # so the writing thread goes on hashing and writing the next piece meanwhile. Small tensors
    # are handed over together, once at least WRITEBACK bytes are waiting.
    flushed = written
    deferred: List[Tuple[int, Future]] = []  # (piece index, its deferred hash update), oldest first

    def hashed_up_to(j: int) -> None:  # updates run in order: the last deferred one up to j suffices
        last = None
        while deferred and deferred[0][0] <= j:
            last = deferred.pop(0)[1]
        if last is not None:
            last.result()

    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-flush") as flusher:
        for i, piece in enumerate(host_pieces([t for _, t in tensors], hashed_up_to, PIECE)):
            fut = hasher.update(piece)
            if fut is not None:
                deferred.append((i, fut))
            _write_all(f, piece)
            written += len(piece)
            if fd is not None and written - flushed >= WRITEBACK:
                flusher.submit(start_writeback, fd, flushed, written - flushed)
                flushed = written
            if on_piece is not None:
                on_piece(written)
        if fd is not None and written > flushed:
            flusher.submit(start_writeback, fd, flushed, written - flushed)
    return written, hasher.hexdigest()


def read_header(f: IO[bytes], where: str, file_size: Optional[int] = None) -> Tuple[Dict[str, Any], int]:
    """Parse a safetensors header: ``(header dict, offset of the data section)``.

    Every tensor entry is checked (known dtype, non-negative shape, ``data_offsets`` inside
    the data section and matching the shape), so callers can trust the offsets."""
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) != 8:
        raise CheckpointError(f"{where} is truncated ({len(prefix)} bytes): not a safetensors file")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER or (file_size is not None and n + 8 > file_size):
        raise CheckpointError(f"{where} is not a valid safetensors file (header length {n} is impossible)")
    raw = f.read(n)
    if len(raw) != n:
        raise CheckpointError(f"{where} is truncated: its header should have {n} bytes, got {len(raw)}")
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except RecursionError:
        raise CheckpointError(f"{where} is not a valid safetensors file (bad header: nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{where} is not a valid safetensors file (bad header: {err})") from None
    data_len = None if file_size is None else file_size - 8 - n
    for key, entry in header.items():
        if key != "__metadata__":
            problem = _entry_problem(entry, data_len)
            if problem:
                raise CheckpointError(f"{where} is not a valid safetensors file (tensor {key[:100]!r}: {problem})")
    return header, 8 + n


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _entry_problem(entry: Any, data_len: Optional[int]) -> Optional[str]:
    """What is wrong with one tensor entry of a safetensors header, or None."""
    if not isinstance(entry, dict):
        return "entry is not an object"
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return f"unknown dtype {str(dtype)[:40]!r}"
    if not isinstance(shape, list) or len(shape) > 64 or not all(_is_int(s) and s >= 0 for s in shape):
        return "shape is not a list of non-negative integers"
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
        return "data_offsets is not a pair of integers"
    begin, end = offs
    if not 0 <= begin <= end or (data_len is not None and end > data_len):
        return f"data_offsets {offs} lie outside the data section"
    nbytes = DTYPES[dtype][1]
    for s in shape:
        nbytes *= s
    if end - begin != nbytes:
        return f"data_offsets {offs} hold {end - begin} bytes but shape {shape} needs {nbytes}"
    return None
