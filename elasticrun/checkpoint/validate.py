"""What is in a checkpoint root, and is it intact?

``list_checkpoints`` classifies every entry as complete, incomplete (no valid commit
marker: a save in progress or one that crashed) or corrupt (metadata unreadable, a file
missing or of the wrong size); ``verify`` re-hashes every file. Nothing here imports
torch, so the CLI's read commands start fast.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Sequence

from elasticrun.checkpoint.checksum import Checksum, file_digest
from elasticrun.checkpoint.format import (
    INCOMPLETE_MARKER,
    LATEST,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    CheckpointMeta,
    FileEntry,
    is_shard_file_name,
    parse_tmp_dir_name,
    validate_name,
)
from elasticrun.checkpoint.storage import LocalStorage, Storage, default_io_threads, describe, get_storage, retry
from elasticrun.errors import CheckpointError


class CheckpointStatus(str, Enum):
    """What ``list_checkpoints`` (and ``elasticrun ckpt list``) says an entry of a root is."""

    COMPLETE = "complete"
    INCOMPLETE = "incomplete"  # no valid commit marker: a save in progress or one that crashed
    CORRUPT = "corrupt"  # metadata unreadable, a file missing or of the wrong size
    ALIAS = "alias"  # a symlink in the root (see CheckpointInfo.alias_of)
    PARTIAL = "partial"  # memory tier: committed, with the other nodes' parts in their memory

    def __str__(self) -> str:
        return self.value


@dataclass
class CheckpointInfo:
    """One entry of a checkpoint root as ``list_checkpoints`` sees it."""

    name: str
    dirname: str
    status: CheckpointStatus
    size: int = 0
    meta: Optional[CheckpointMeta] = None
    problem: Optional[str] = None
    temporary: bool = False  # a ``.<name>.tmp-*`` directory: a save in progress or a crashed one
    latest: bool = False
    #: For a symlink in the root (an alias such as ``best -> step-00001000``): the entry it points
    #: to (a name in the root, or the link text when it points elsewhere). Aliases are never
    #: "latest", never counted or deleted by retention, and deleting one removes only the link.
    alias_of: Optional[str] = None
    #: Whether the entry is recognisably this format's (a commit marker of this format, the
    #: writer's temporary name or marker file, or shard files): only those are ever deleted by
    #: ``--incomplete``.
    ours: bool = True

    @property
    def created(self) -> Optional[float]:
        return None if self.meta is None else self.meta.created

    def order_key(self) -> Any:
        """Sort key: training step, then commit sequence (see CheckpointMeta.order_key), then name."""
        return (self.meta.order_key() if self.meta is not None else (-1, -1, 0.0)), self.name

    def to_json(self) -> Dict[str, Any]:
        m = self.meta
        return {
            "name": self.name,
            "dir": self.dirname,
            "status": self.status.value,
            "latest": self.latest,
            "temporary": self.temporary,
            "size": self.size,
            "created": self.created,
            "step": None if m is None else m.step,
            "epoch": None if m is None else m.epoch,
            "world_size": None if m is None else m.world_size,
            "problem": self.problem,
            "seq": None if m is None else m.seq,
            "alias_of": self.alias_of,
        }


@dataclass
class VerifyResult:
    """Outcome of re-hashing a checkpoint's files."""

    name: str
    problems: List[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "problems": self.problems, "files_checked": self.files_checked,
                "bytes_checked": self.bytes_checked}


def read_meta(storage: Storage, name: str) -> CheckpointMeta:
    """The parsed ``metadata.json`` of ``<root>/<name>``; CheckpointError if absent or bad."""
    return CheckpointMeta.loads(read_meta_bytes(storage, name), meta_path(storage, name))


def meta_path(storage: Storage, name: str) -> str:
    return storage.display(f"{storage.join(name)}/{METADATA_FILE}")


def read_meta_bytes(storage: Storage, name: str) -> bytes:
    """The raw ``metadata.json`` of ``<root>/<name>``; CheckpointError if the checkpoint is absent or uncommitted."""
    path = f"{storage.join(name)}/{METADATA_FILE}"
    if not retry(lambda: storage.exists(storage.join(name)), f"check {storage.display(storage.join(name))}"):
        raise CheckpointError(
            f"no checkpoint {name!r} in {storage.display(storage.root)}: see `elasticrun ckpt list "
            f"{storage.display(storage.root)}`"
        )
    if not retry(lambda: storage.exists(path), f"check {storage.display(path)}"):
        raise CheckpointError(
            f"checkpoint {name!r} in {storage.display(storage.root)} is incomplete (no {METADATA_FILE}: it was "
            "never committed) and cannot be loaded: load another one or delete it"
        )
    return read_small_file(storage, path, MAX_METADATA_BYTES)


def read_small_file(storage: Storage, path: str, limit: int) -> bytes:
    """The bytes of a small file, refusing anything but a regular file (a FIFO or a device
    such as ``/dev/zero`` behind a symlink would hang or never end) and files over ``limit``."""
    where = storage.display(path)
    if not isinstance(storage, LocalStorage):
        size = retry(lambda: storage.size(path), f"stat {where}")
        if size > limit:
            raise CheckpointError(f"{where} has {size} bytes, more than the {limit >> 20} MiB allowed: refusing it")
        return storage.read_bytes(path)

    def op() -> bytes:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where} is not a regular file: refusing to read it (the checkpoint is corrupt)")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped after the stat: still refuse
                raise CheckpointError(f"{where} is not a regular file: refusing to read it")
            chunks, total = [], 0
            while total <= limit:
                chunk = os.read(fd, min(1 << 20, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        finally:
            os.close(fd)
        if total > limit:
            raise CheckpointError(f"{where} is larger than {limit >> 20} MiB: refusing to read it")
        return b"".join(chunks)

    return retry(op, f"read {where}")


def _dir_size(storage: Storage, path: str) -> int:
    total = 0
    for f in storage.listdir(path):
        try:
            total += storage.size(f"{path}/{f}")
        except (OSError, FileNotFoundError):
            pass
    return total


def size_problem(storage: Storage, name: str, entry: FileEntry) -> Optional[str]:
    """Whether file ``entry`` of checkpoint ``name`` is missing or has the wrong size; the problem or None."""
    path = f"{storage.join(name)}/{entry.name}"
    try:
        if isinstance(storage, LocalStorage):
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                return f"file {entry.name} of checkpoint {name!r} is not a regular file"
            size = st.st_size
        else:
            size = storage.size(path)
    except (OSError, FileNotFoundError):
        return f"file {entry.name} of checkpoint {name!r} is missing"
    if size != entry.size:
        return f"file {entry.name} of checkpoint {name!r} has {size} bytes, metadata says {entry.size} (truncated?)"
    return None


def check_files(storage: Storage, name: str, meta: CheckpointMeta) -> Optional[str]:
    """A cheap structural check (files present, sizes right); the problem or None."""
    for f in meta.files.values():
        problem = size_problem(storage, name, f)
        if problem:
            return problem
    return None


def _alias_target(storage: Storage, dirname: str) -> Optional[str]:
    """For a symlink in a local root: the name it points to in the root, or the link text."""
    if not isinstance(storage, LocalStorage):
        return None
    path = storage.join(dirname)
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    if os.path.dirname(target) == os.path.realpath(storage.root):
        return os.path.basename(target)
    return os.readlink(path)


def _looks_ours(storage: Storage, path: str) -> bool:
    """A directory without a commit marker that this format's writer made (marker file or shards)."""
    try:
        names = storage.listdir(path)
    except (OSError, FileNotFoundError):
        return False
    return INCOMPLETE_MARKER in names or any(is_shard_file_name(n) for n in names)


def inspect_entry(storage: Storage, dirname: str) -> Optional[CheckpointInfo]:
    """Classify one directory of the root; None if it is not a checkpoint at all."""
    path = storage.join(dirname)
    if not storage.isdir(path):
        return None
    alias = _alias_target(storage, dirname)
    info = _inspect_dir(storage, dirname, path)
    if alias is not None:
        if info.status != CheckpointStatus.COMPLETE:
            info.problem = f"points to a {info.status} checkpoint: {info.problem}"
        info.alias_of, info.temporary, info.ours, info.status = alias, False, False, CheckpointStatus.ALIAS
    return info


def _inspect_dir(storage: Storage, dirname: str, path: str) -> CheckpointInfo:
    tmp_of = parse_tmp_dir_name(dirname)
    if tmp_of is not None:
        return CheckpointInfo(tmp_of, dirname, CheckpointStatus.INCOMPLETE, _dir_size(storage, path), temporary=True,
                              problem="save in progress or crashed before its commit")
    if not storage.exists(f"{path}/{METADATA_FILE}"):
        return CheckpointInfo(dirname, dirname, CheckpointStatus.INCOMPLETE, _dir_size(storage, path),
                              problem=f"no {METADATA_FILE}", ours=_looks_ours(storage, path))
    try:
        meta = read_meta(storage, dirname)
    except CheckpointError as err:
        foreign = "not an elasticrun checkpoint metadata file" in str(err)
        return CheckpointInfo(dirname, dirname, CheckpointStatus.CORRUPT, _dir_size(storage, path), problem=str(err),
                              ours=not foreign or _looks_ours(storage, path))
    problem = check_files(storage, dirname, meta)
    status = CheckpointStatus.CORRUPT if problem else CheckpointStatus.COMPLETE
    return CheckpointInfo(dirname, dirname, status, _dir_size(storage, path), meta=meta, problem=problem)


def is_ordered(info: CheckpointInfo) -> bool:
    """Whether an entry takes part in ordering, "latest" and retention: complete (not an alias)."""
    return info.status == CheckpointStatus.COMPLETE and info.alias_of is None and not info.temporary


def scan(storage: Storage) -> List[CheckpointInfo]:
    """Every checkpoint-like entry of the root: complete ones oldest first (by step, then commit
    sequence: see CheckpointMeta.order_key), then aliases and the others."""
    if not retry(lambda: storage.exists(storage.root), f"check {storage.display(storage.root)}"):
        return []
    if not storage.isdir(storage.root):
        raise CheckpointError(f"{storage.display(storage.root)} is a file, not a checkpoint directory")
    infos = []
    for dirname in retry(lambda: storage.listdir(storage.root), f"list {storage.display(storage.root)}"):
        try:
            info = inspect_entry(storage, dirname)
        except (FileNotFoundError, NotADirectoryError):
            continue  # renamed or deleted while we looked (a commit or retention in progress)
        except CheckpointError as err:
            info = CheckpointInfo(dirname, dirname, CheckpointStatus.CORRUPT, problem=str(err))
        except Exception as err:  # noqa: BLE001 - one hostile entry must never break listing the root
            info = CheckpointInfo(dirname, dirname, CheckpointStatus.CORRUPT, problem=describe(err)[:300])
        if info is not None:
            infos.append(info)
    infos.sort(key=lambda i: (not is_ordered(i), i.alias_of is None, i.order_key()))
    complete = [i for i in infos if is_ordered(i)]
    if complete:
        complete[-1].latest = True
    return infos


def next_seq(storage: Storage) -> int:
    """The commit sequence number for a new checkpoint: 1 + the highest one in the root."""
    seqs = [i.meta.seq for i in scan(storage) if i.meta is not None and i.meta.seq is not None]
    return max(seqs, default=0) + 1


def list_checkpoints(root: str, storage_options: Optional[Dict[str, Any]] = None) -> List[CheckpointInfo]:
    """Checkpoints under ``root`` with their status; the newest complete one has ``latest=True``."""
    return scan(get_storage(root, storage_options))


def resolve_name(storage: Storage, name: str) -> str:
    """``latest`` -> the newest complete checkpoint's name; other names are validated."""
    if name == LATEST:
        complete = [i for i in scan(storage) if i.latest]
        if not complete:
            raise CheckpointError(f"no complete checkpoint in {storage.display(storage.root)} to load as 'latest'")
        return complete[0].name
    return validate_name(name)


def hash_file(storage: Storage, path: str, size: int, algo: Checksum,
              progress: Optional[Callable[[int], None]] = None) -> str:
    """The checksum of the first ``size`` bytes of a file, read front to back in large blocks
    (hashed on a helper thread while the next block is read)."""
    with storage.open_read(path) as f:
        def read_into(_offset: int, view: memoryview) -> None:  # blocks come in order: plain reads
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{storage.display(path)} ended after {_offset + got} bytes")
                got += n

        return file_digest(read_into, size, algo, progress=progress)


def checksum_mismatch(name: str, entry: FileEntry, got: Optional[str] = None) -> str:
    """The one-line problem of a file whose bytes do not match its checksum in ``metadata.json``."""
    seen = "" if got is None else f" ({entry.algo.value} {got[:16]} but metadata says {entry.digest[:16]})"
    return (f"file {entry.name} of checkpoint {name!r} is corrupt: its {entry.algo.value} does not match "
            f"metadata.json{seen}")


def verify_file(storage: Storage, name: str, entry: FileEntry,
                progress: Optional[Callable[[int], None]] = None) -> Optional[str]:
    """Re-hash one file of checkpoint ``name``; the problem (naming the file) or None."""
    problem = size_problem(storage, name, entry)
    if problem:
        return problem
    path = f"{storage.join(name)}/{entry.name}"
    try:
        digest = hash_file(storage, path, entry.size, entry.algo, progress)
    except OSError as err:
        return f"file {entry.name} of checkpoint {name!r} cannot be read: {describe(err)}"
    return None if digest == entry.digest else checksum_mismatch(name, entry, digest)


def verify_files(storage: Storage, name: str, files: Sequence[FileEntry],
                 progress: Optional[Callable[[int], None]] = None) -> List[str]:
    """Re-hash ``files`` (several at once: hashing releases the GIL); the problems, in file order."""
    threads = min(default_io_threads(), len(files))
    if threads <= 1:
        return [p for p in (verify_file(storage, name, f, progress) for f in files) if p]
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-verify") as pool:
        return [p for p in pool.map(lambda f: verify_file(storage, name, f, progress), files) if p]


def verify(root: str, name: str = LATEST, *, storage_options: Optional[Dict[str, Any]] = None,
           progress: Optional[Callable[[int], None]] = None) -> VerifyResult:
    """Re-hash every file of checkpoint ``name`` against ``metadata.json``; never raises on a mismatch
    (see ``VerifyResult.problems``), raises CheckpointError if the checkpoint can't be found or parsed."""
    storage = get_storage(root, storage_options)
    name = resolve_name(storage, name)
    meta = read_meta(storage, name)
    files = list(meta.files.values())
    problems = verify_files(storage, name, files, progress)
    return VerifyResult(name, problems, len(files), sum(f.size for f in files))
