"""Per-file checksums of checkpoint shard files: which algorithms exist and a running digest.

Every shard file's checksum is stored in ``metadata.json`` and checked on load and by
``elasticrun ckpt verify``. Two algorithms for checkpoints on disk (the public format):

- ``crc32`` (the default): zlib's CRC-32. It catches what happens to checkpoints by
  accident — torn or truncated writes, flipped bits, a copy cut short — and runs at several
  GB/s on one core, so it hides behind the disk on save and load.
- ``sha256``: a cryptographic digest, ~2.5× the CPU of ``crc32``; choose it when the files
  pass through hands you do not trust (``save(..., checksum="sha256")``).

Both release the GIL on large buffers, so hashing runs beside the I/O threads. Checkpoints of
format version 1 always carry sha256.

Memory snapshots (generations in ``/dev/shm``) carry ``wordsum`` instead
(:mod:`elasticrun.checkpoint.wordsum`): sums of 64-bit words, several times faster than CRC-32,
so that a restore can check every byte it copies and still run at memory speed. It is not
offered to ``save()``: a generation persisted to disk gets CRC-32, computed while it is copied.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from enum import Enum
from typing import Callable, List, Optional, Union

from elasticrun.checkpoint.wordsum import WordSum
from elasticrun.errors import CheckpointError


class Checksum(str, Enum):
    """A per-file checksum algorithm; its value is the key under which ``metadata.json`` stores it."""

    CRC32 = "crc32"
    SHA256 = "sha256"
    WORDSUM = "wordsum"  # memory snapshots only (see the module doc)

    @property
    def hex_length(self) -> int:
        """Length of the digest as lowercase hex."""
        return {Checksum.CRC32: 8, Checksum.WORDSUM: 32}.get(self, 64)

    def is_digest(self, text: str) -> bool:
        """Whether ``text`` is a well-formed digest of this algorithm (lowercase hex of the right length)."""
        return bool(re.fullmatch(f"[0-9a-f]{{{self.hex_length}}}", text))


#: What ``save()`` writes unless told otherwise.
DEFAULT_CHECKSUM = Checksum.CRC32

#: The algorithms a checkpoint on disk may carry (what ``save()`` and ``ckpt save`` offer).
DISK_CHECKSUMS = (Checksum.CRC32, Checksum.SHA256)

#: What memory snapshots carry.
MEMORY_CHECKSUM = Checksum.WORDSUM


def parse_checksum(value: Union[str, Checksum, None]) -> Checksum:
    """``"crc32"``/``"sha256"`` (any case) or one of them as a Checksum -> Checksum; None -> the
    default. Anything else (``wordsum`` included: memory snapshots only) is a CheckpointError
    naming the choices."""
    if value is None:
        return DEFAULT_CHECKSUM
    try:
        algo = value if isinstance(value, Checksum) else Checksum(str(value).lower())
    except ValueError:
        algo = None
    if algo not in DISK_CHECKSUMS:
        choices = ", ".join(c.value for c in DISK_CHECKSUMS)
        what = ("checksum 'wordsum' is for memory snapshots only" if algo is Checksum.WORDSUM
                else f"unknown checksum {str(value)[:40]!r}")
        raise CheckpointError(f"{what}: use one of {choices}")
    return algo


class Digest:
    """A running checksum: ``update`` with the bytes in order, then ``hexdigest``."""

    def __init__(self, algo: Checksum) -> None:
        self.algo = algo
        self._crc = 0
        self._sha = hashlib.sha256() if algo is Checksum.SHA256 else None
        self._sum = WordSum() if algo is Checksum.WORDSUM else None
        self._offset = 0  # bytes seen so far (wordsum weighs each byte by its position)

    def update(self, data: Union[bytes, bytearray, memoryview]) -> None:
        if self._sha is not None:
            self._sha.update(data)
        elif self._sum is not None:
            self._sum.add(self._offset, data)
            self._offset += memoryview(data).nbytes
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        if self._sum is not None:
            return self._sum.hexdigest()
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def digest_of(algo: Checksum, data: Union[bytes, bytearray, memoryview]) -> str:
    """The checksum of ``data`` in one call."""
    d = Digest(algo)
    d.update(data)
    return d.hexdigest()


#: Block size of :func:`file_digest`'s reads.
DIGEST_BLOCK = 16 << 20


def file_digest(read_into: Callable[[int, memoryview], None], size: int, algo: Checksum, *,
                overlap: bool = True, progress: Optional[Callable[[int], None]] = None) -> str:
    """The checksum of ``size`` bytes that ``read_into(offset, view)`` fills block by block.

    With ``overlap`` (a spare core) block i is hashed on a helper thread while block i+1 is
    read, so a cold file costs about its read time. Plain reads into two reused buffers, not a
    memory map: a cold file's page faults would stall the hashing thread (several times slower)."""
    digest = Digest(algo)
    helper = overlap and size > DIGEST_BLOCK
    bufs = [memoryview(bytearray(min(size, DIGEST_BLOCK) or 1)) for _ in range(2 if helper else 1)]
    pending: List[Optional[Future]] = [None] * len(bufs)
    # one worker: updates stay in order
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") if helper else nullcontext() as pool:
        for i, off in enumerate(range(0, size, DIGEST_BLOCK)):
            k = i % len(bufs)
            fut = pending[k]
            if fut is not None:
                fut.result()  # this buffer's previous block is hashed: reuse it
            view = bufs[k][:min(DIGEST_BLOCK, size - off)]
            read_into(off, view)
            if pool is None:
                digest.update(view)
            else:
                pending[k] = pool.submit(digest.update, view)
            if progress is not None:
                progress(len(view))
        for fut in pending:
            if fut is not None:
                fut.result()
    return digest.hexdigest()
