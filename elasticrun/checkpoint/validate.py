"""What is in a checkpoint root, and is it intact?

``list_checkpoints`` classifies every entry as complete, incomplete (no valid commit
marker: a save in progress or one that crashed) or corrupt (metadata unreadable, a file
missing or of the wrong size); ``verify`` re-hashes every file. Nothing here imports
torch, so the CLI's read commands start fast.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from elasticrun.checkpoint.format import (
    LATEST,
    METADATA_FILE,
    CheckpointMeta,
    FileEntry,
    parse_tmp_dir_name,
    validate_name,
)
from elasticrun.checkpoint.storage import Storage, default_io_threads, describe, get_storage, retry
from elasticrun.errors import CheckpointError

COMPLETE, INCOMPLETE, CORRUPT = "complete", "incomplete", "corrupt"
_BLOCK = 16 << 20


@dataclass
class CheckpointInfo:
    """One entry of a checkpoint root as ``list_checkpoints`` sees it."""

    name: str
    dirname: str
    status: str
    size: int = 0
    meta: Optional[CheckpointMeta] = None
    problem: Optional[str] = None
    temporary: bool = False  # a ``.<name>.tmp-*`` directory: a save in progress or a crashed one
    latest: bool = False

    @property
    def created(self) -> Optional[float]:
        return None if self.meta is None else self.meta.created

    def to_json(self) -> Dict[str, Any]:
        m = self.meta
        return {
            "name": self.name,
            "dir": self.dirname,
            "status": self.status,
            "latest": self.latest,
            "temporary": self.temporary,
            "size": self.size,
            "created": self.created,
            "step": None if m is None else m.step,
            "epoch": None if m is None else m.epoch,
            "world_size": None if m is None else m.world_size,
            "problem": self.problem,
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
    return storage.read_bytes(path)


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
    try:
        size = storage.size(f"{storage.join(name)}/{entry.name}")
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


def inspect_entry(storage: Storage, dirname: str) -> Optional[CheckpointInfo]:
    """Classify one directory of the root; None if it is not a checkpoint at all."""
    path = storage.join(dirname)
    if not storage.isdir(path):
        return None
    tmp_of = parse_tmp_dir_name(dirname)
    if tmp_of is not None:
        return CheckpointInfo(tmp_of, dirname, INCOMPLETE, _dir_size(storage, path), temporary=True,
                              problem="save in progress or crashed before its commit")
    if not storage.exists(f"{path}/{METADATA_FILE}"):
        return CheckpointInfo(dirname, dirname, INCOMPLETE, _dir_size(storage, path), problem=f"no {METADATA_FILE}")
    try:
        meta = read_meta(storage, dirname)
    except CheckpointError as err:
        return CheckpointInfo(dirname, dirname, CORRUPT, _dir_size(storage, path), problem=str(err))
    problem = check_files(storage, dirname, meta)
    status = CORRUPT if problem else COMPLETE
    return CheckpointInfo(dirname, dirname, status, _dir_size(storage, path), meta=meta, problem=problem)


def scan(storage: Storage) -> List[CheckpointInfo]:
    """Every checkpoint-like entry of the root: complete ones oldest first, then the others."""
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
        except OSError as err:
            info = CheckpointInfo(dirname, dirname, CORRUPT, problem=describe(err))
        if info is not None:
            infos.append(info)
    infos.sort(key=lambda i: (i.status != COMPLETE, i.created or 0.0, i.name))
    complete = [i for i in infos if i.status == COMPLETE]
    if complete:
        complete[-1].latest = True
    return infos


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


def hash_file(storage: Storage, path: str, progress: Optional[Callable[[int], None]] = None) -> str:
    """sha256 of a whole file, read in large blocks."""
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with storage.open_read(path) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


def verify_file(storage: Storage, name: str, entry: FileEntry,
                progress: Optional[Callable[[int], None]] = None) -> Optional[str]:
    """Re-hash one file of checkpoint ``name``; the problem (naming the file) or None."""
    problem = size_problem(storage, name, entry)
    if problem:
        return problem
    path = f"{storage.join(name)}/{entry.name}"
    try:
        digest = hash_file(storage, path, progress)
    except OSError as err:
        return f"file {entry.name} of checkpoint {name!r} cannot be read: {describe(err)}"
    if digest != entry.sha256:
        return (f"file {entry.name} of checkpoint {name!r} is corrupt: sha256 {digest[:16]}… but metadata "
                f"says {entry.sha256[:16]}…")
    return None


def verify_files(storage: Storage, name: str, files: Sequence[FileEntry],
                 progress: Optional[Callable[[int], None]] = None) -> List[str]:
    """Re-hash ``files`` (several at once: sha256 releases the GIL); the problems, in file order."""
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
