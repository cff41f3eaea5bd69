"""Per-file checksums of checkpoint shard files: which algorithms exist and a running digest.

Every shard file's checksum is stored in ``metadata.json`` and checked on load and by
``elasticrun ckpt verify``. Two algorithms:

- ``crc32`` (the default): zlib's CRC-32. It catches what happens to checkpoints by
  accident — torn or truncated writes, flipped bits, a copy cut short — and runs at several
  GB/s on one core, so it hides behind the disk on save and load.
- ``sha256``: a cryptographic digest, ~2.5× the CPU of ``crc32``; choose it when the files
  pass through hands you do not trust (``save(..., checksum="sha256")``).

Both release the GIL on large buffers, so hashing runs beside the I/O threads. Checkpoints of
format version 1 always carry sha256.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from enum import Enum
from typing import Callable, List, Optional, Union

from elasticrun.errors import CheckpointError


class Checksum(str, Enum):
    """A per-file checksum algorithm; its value is the key under which ``metadata.json`` stores it."""

    CRC32 = "crc32"
    SHA256 = "sha256"

    @property
    def hex_length(self) -> int:
        """Length of the digest as lowercase hex."""
        return 8 if self is Checksum.CRC32 else 64

    def is_digest(self, text: str) -> bool:
        """Whether ``text`` is a well-formed digest of this algorithm (lowercase hex of the right length)."""
        return bool(re.fullmatch(f"[0-9a-f]{{{self.hex_length}}}", text))


#: What ``save()`` writes unless told otherwise.
DEFAULT_CHECKSUM = Checksum.CRC32


def parse_checksum(value: Union[str, Checksum, None]) -> Checksum:
    """``"crc32"``/``"sha256"`` (any case) or a Checksum -> Checksum; None -> the default.
    Anything else is a CheckpointError naming the choices."""
    if value is None:
        return DEFAULT_CHECKSUM
    if isinstance(value, Checksum):
        return value
    try:
        return Checksum(str(value).lower())
    except ValueError:
        choices = ", ".join(c.value for c in Checksum)
        raise CheckpointError(f"unknown checksum {str(value)[:40]!r}: use one of {choices}") from None


class Digest:
    """A running checksum: ``update`` with the bytes in order, then ``hexdigest``."""

    def __init__(self, algo: Checksum) -> None:
        self.algo = algo
        self._crc = 0
        self._sha = hashlib.sha256() if algo is Checksum.SHA256 else None

    def update(self, data: Union[bytes, bytearray, memoryview]) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
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
