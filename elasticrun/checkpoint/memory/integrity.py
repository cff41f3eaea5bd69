"""Checking a node's own memory files against their checksums before a restore uses them.

Shared memory is writable by any process of the user (and by root): bytes can change after a
generation was committed, without a trace in its metadata. A restore therefore hashes every
local file it is about to load (:func:`corrupt_files`) — the files are in RAM, so this is a
checksum pass at memory speed, split over the node's ranks and run on several threads (zlib
releases the GIL). Files fetched from peers are checked on receipt instead
(:mod:`~elasticrun.checkpoint.memory.replicas`).
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

from elasticrun.checkpoint.checksum import file_digest
from elasticrun.checkpoint.format import FileEntry
from elasticrun.checkpoint.storage import default_io_threads


def file_matches(path: str, entry: FileEntry) -> bool:
    """Whether the file at ``path`` has ``entry``'s size and checksum (False when unreadable).

    Plain reads into one reused buffer, not a memory map: a file truncated meanwhile must give a
    short read, never a SIGBUS."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size != entry.size:
            return False

        def read_into(offset: int, view: memoryview) -> None:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n <= 0:
                    raise OSError(f"{path} changed size while it was checked")
                got += n

        # No helper thread: a read from RAM is a copy, and handing blocks to a hashing thread cost
        # more than it overlapped (measured ~1.6x the CPU); files are hashed in parallel instead.
        return file_digest(read_into, entry.size, entry.algo, overlap=False) == entry.digest
    except OSError:
        return False
    finally:
        os.close(fd)


def corrupt_files(files: Sequence[Tuple[str, Optional[str], FileEntry]],
                  threads: Optional[int] = None) -> List[str]:
    """The names among ``files`` (``(name, local path, entry)``) whose local bytes do not match
    their entry — a missing path counts as corrupt — hashed on up to ``threads`` threads."""
    def bad(item: Tuple[str, Optional[str], FileEntry]) -> bool:
        _name, path, entry = item
        return path is None or not file_matches(path, entry)

    if not files:
        return []
    workers = max(1, min(threads or default_io_threads(), len(files)))
    with ThreadPoolExecutor(workers, thread_name_prefix="snap-verify") as pool:
        flags = list(pool.map(bad, files))
    return [name for (name, _p, _e), is_bad in zip(files, flags) if is_bad]


__all__ = ["corrupt_files", "file_matches"]
