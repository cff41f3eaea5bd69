"""Checking the bytes a memory restore loads, as it copies them.

Shared memory is writable by any process of the user (and by root): bytes can change after a
generation was committed, without a trace in its metadata. A restore therefore reads a
generation through a :class:`CheckedRoot`: each shard file is opened as a :class:`CheckedFile`,
which hashes every block right after ``pread`` put it in its destination (the caller's tensor,
or a staging buffer on its way to the GPU), while the block is still in the CPU cache. The
checksum of memory generations, ``wordsum`` (:mod:`elasticrun.checkpoint.wordsum`), adds up
over parts in any order, so the loader's threads hash what they read where they read it, and
:meth:`CheckedRoot.failures` afterwards hashes only what the load did not read (the header, the
parts of a file other ranks load) and names the files whose sum does not match. What is
checked is exactly what was loaded: no second pass over the bytes, and no window between a
check and the copy.

The caller decides what to do with a failure (:mod:`~elasticrun.checkpoint.memory.load`): the
bytes are already in the tensors, so it loads them again from a good copy, or fails.
"""

from __future__ import annotations

import io
import os
import stat
import threading
from typing import Dict, List, Optional, Tuple, Union

from elasticrun.checkpoint.checksum import Checksum, Digest
from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta, FileEntry
from elasticrun.checkpoint.storage import LocalStorage, describe
from elasticrun.checkpoint.wordsum import WordSum, wordsum_part

#: Bytes read and then hashed at a time: small enough to be hashed from the CPU cache.
STEP = 1 << 20


class CheckedFile:
    """A shard file opened for reading whose every read is hashed (``wordsum``) on the way.

    File-like for the checkpoint reader: ``seek``/``tell``/``read``/``readinto``, a position per
    thread. It has no ``fileno``, so the reader reads through :meth:`readinto` (where the hashing
    is) rather than with its own ``pread``. :meth:`close` keeps the descriptor:
    :meth:`CheckedRoot.failures` reads the parts that were not loaded afterwards."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        self.sum = WordSum()
        self.spans: List[Tuple[int, int]] = []  # [start, end) of every read, in the order done
        self._lock = threading.Lock()
        self._where = threading.local()

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a checked file is read through readinto(), which hashes what it reads")

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.tell(), os.SEEK_END: os.fstat(self.fd).st_size}[whence]
        self._where.pos = base + offset
        return self._where.pos

    def tell(self) -> int:
        return getattr(self._where, "pos", 0)

    def readinto(self, buffer: Union[bytearray, memoryview]) -> int:
        """Fill ``buffer`` from the current position (less at the end of the file), hashing each
        block as soon as it is read; returns the number of bytes read."""
        view = memoryview(buffer).cast("B")
        start = got = self.tell()
        while got - start < len(view):
            part = view[got - start:got - start + STEP]
            n = os.preadv(self.fd, [part], got)
            if n <= 0:
                break
            a, b = wordsum_part(got, part[:n])
            with self._lock:
                self.sum.add_share(a, b)
            got += n
        with self._lock:
            self.spans.append((start, got))
        self._where.pos = got
        return got - start

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, os.fstat(self.fd).st_size - self.tell())
        buf = bytearray(size)
        return bytes(buf[:self.readinto(buf)])

    def close(self) -> None:
        """Nothing yet: the descriptor stays open for the check (:meth:`release` closes it)."""

    def release(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> CheckedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def problem(self, entry: FileEntry) -> Optional[str]:
        """Why the file's bytes that were read (and the rest, hashed now) do not match ``entry``;
        None when they do."""
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                return f"it has {st.st_size} bytes, not {entry.size}"
            if entry.algo is not Checksum.WORDSUM:  # not written by the memory tier: hash it whole
                return None if self._digest(entry) == entry.digest else f"its {entry.algo.value} does not match"
            total = WordSum()
            with self._lock:
                total.add_share(self.sum.a, self.sum.b)
                spans = sorted(s for s in self.spans if s[1] > s[0])
            if spans and spans[-1][1] > entry.size:
                return f"it had more than {entry.size} bytes while it was read"
            pos = 0
            for a, b in spans + [(entry.size, entry.size)]:
                if a < pos:
                    return "some of its bytes were read twice, which the check cannot tell apart"
                self._hash_range(total, pos, a)
                pos = b
            return None if total.hexdigest() == entry.digest else "its wordsum does not match"
        except OSError as err:
            return f"it cannot be read: {describe(err)}"

    def _hash_range(self, total: WordSum, start: int, end: int) -> None:
        buf = memoryview(bytearray(min(STEP, max(end - start, 0))))
        pos = start
        while pos < end:
            n = os.preadv(self.fd, [buf[:min(STEP, end - pos)]], pos)
            if n <= 0:
                raise OSError(f"{self.path} changed size while it was checked")
            total.add(pos, buf[:n])
            pos += n

    def _digest(self, entry: FileEntry) -> str:
        digest, pos = Digest(entry.algo), 0
        buf = memoryview(bytearray(min(STEP, entry.size) or 1))
        while pos < entry.size:
            n = os.preadv(self.fd, [buf[:min(STEP, entry.size - pos)]], pos)
            if n <= 0:
                raise OSError(f"{self.path} changed size while it was checked")
            digest.update(buf[:n])
            pos += n
        return digest.hexdigest()


class CheckedRoot(LocalStorage):
    """A local checkpoint root whose shard files are opened as :class:`CheckedFile` (never
    memory-mapped: a map's bytes are not read through ``readinto``). Pass it to
    :func:`elasticrun.checkpoint.load` as the root, then call :meth:`failures`, then :meth:`close`."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.mappable = False
        self._opened: List[Tuple[str, CheckedFile]] = []
        self._lock = threading.Lock()

    def open_read(self, path: str) -> CheckedFile:  # type: ignore[override]
        if os.path.basename(path) == METADATA_FILE:
            return super().open_read(path)  # type: ignore[return-value]
        f = CheckedFile(path)
        with self._lock:
            self._opened.append((os.path.basename(path), f))
        return f

    def failures(self, meta: CheckpointMeta) -> Dict[str, str]:
        """``{file: why}`` for every shard file read through this root whose bytes do not match
        ``meta`` (a file it does not list counts as failed); the parts not read are hashed now."""
        with self._lock:
            opened = list(self._opened)
        out: Dict[str, str] = {}
        for fname, f in opened:
            entry = meta.files.get(fname)
            why = f.problem(entry) if entry is not None else "metadata.json does not list it"
            if why is not None:
                out.setdefault(fname, why)
        return out

    def close(self) -> None:
        """Close every file opened through this root."""
        with self._lock:
            opened, self._opened = self._opened, []
        for _name, f in opened:
            try:
                f.release()
            except OSError:
                pass


__all__ = ["STEP", "CheckedFile", "CheckedRoot"]
