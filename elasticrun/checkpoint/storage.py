"""Where checkpoint bytes live: a local/shared filesystem, or anything fsspec can reach.

Both backends offer the same small set of operations (used by the writer, reader,
commit, listing and retention) so the format never changes with the storage. Transient
errors (timeouts, resets, EAGAIN, ...) are retried with exponential backoff by
:func:`retry`; anything else surfaces at once as a one-line CheckpointError.
"""

from __future__ import annotations

import abc
import errno
import os
import random
import shutil
import time
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, TypeVar, Union

from elasticrun.errors import CheckpointError
from elasticrun.job import env as job_env

T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET,
    errno.ECONNREFUSED, errno.ECONNABORTED, errno.ESTALE, errno.ENETUNREACH,
}
def _retries_from_env() -> int:
    """``ELASTICRUN_CKPT_RETRIES``: attempts of a transient-failing operation (0 or 1: no retries)."""
    raw = os.environ.get(job_env.CKPT_RETRIES, "5")
    try:
        return max(1, min(int(raw), 100))
    except ValueError:
        return 5


RETRY_ATTEMPTS = _retries_from_env()
RETRY_BASE_DELAY = 0.05

_JITTER = random.Random()  # private: never draw from the global `random` a training script checkpoints


def is_transient(err: BaseException) -> bool:
    """Whether an I/O error is worth retrying (network blips, busy/locked resources)."""
    if isinstance(err, (TimeoutError, ConnectionError)):
        return True
    if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
        return True
    return bool(getattr(err, "transient", False))


def describe(err: BaseException) -> str:
    """A short human description of an I/O error (no traceback)."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} ({errno.errorcode.get(err.errno or 0, err.errno)})"
    return f"{err.__class__.__name__}: {err}"


def retry(fn: Callable[[], T], what: str, attempts: Optional[int] = None) -> T:
    """Call ``fn``; retry transient errors with jittered exponential backoff; wrap the final one."""
    attempts = max(1, RETRY_ATTEMPTS if attempts is None else attempts)
    delay = RETRY_BASE_DELAY
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - classified below
            if not is_transient(err) or attempt == attempts:
                extra = f" after {attempt} attempts" if attempt > 1 else ""
                raise CheckpointError(f"cannot {what}{extra}: {describe(err)}") from err
        time.sleep(delay * (0.5 + _JITTER.random()))
        delay = min(delay * 2, 2.0)
    raise AssertionError("unreachable")


def cpu_share() -> int:
    """This process's share of the machine's CPUs: usable CPUs // LOCAL_WORLD_SIZE (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cpus // local)


def default_io_threads() -> int:
    """Files a rank writes (and hashes) in parallel by default: its CPU share, at most 4."""
    return min(4, cpu_share())


class Storage(abc.ABC):
    """Operations on paths below a checkpoint root. Paths are strings joined with '/'.

    A backend implements the abstract methods; :func:`register_storage` makes it the one used
    for a URL scheme (``myfs://...``), and :func:`get_storage` also accepts a ready instance.
    """

    #: True when a directory rename is atomic (local/POSIX), so the commit is a rename.
    atomic_rename: bool = True
    #: True when files are local (POSIX) and can be memory-mapped.
    mappable: bool = False
    root: str

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if self.root else "/".join(parts)

    def display(self, path: str) -> str:
        return path

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...
    @abc.abstractmethod
    def isdir(self, path: str) -> bool: ...
    @abc.abstractmethod
    def listdir(self, path: str) -> List[str]: ...
    @abc.abstractmethod
    def size(self, path: str) -> int: ...
    @abc.abstractmethod
    def mkdirs(self, path: str) -> None: ...
    @abc.abstractmethod
    def open_read(self, path: str) -> IO[bytes]: ...
    @abc.abstractmethod
    def open_write(self, path: str) -> IO[bytes]: ...
    @abc.abstractmethod
    def finish_write(self, f: IO[bytes]) -> None: ...
    @abc.abstractmethod
    def remove_tree(self, path: str) -> None: ...
    @abc.abstractmethod
    def rename_dir(self, src: str, dst: str) -> None: ...
    @abc.abstractmethod
    def move_file(self, src: str, dst: str) -> None: ...
    @abc.abstractmethod
    def sync_dir(self, path: str) -> None: ...

    def read_bytes(self, path: str) -> bytes:
        def op() -> bytes:
            with self.open_read(path) as f:
                return f.read()

        return retry(op, f"read {self.display(path)}")

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file durably (fsync where the backend has it)."""

        def op() -> None:
            f = self.open_write(path)
            try:
                f.write(data)
                self.finish_write(f)
            finally:
                f.close()

        retry(op, f"write {self.display(path)}")


#: Filesystems whose files are safe to memory-map for a long time: on network and FUSE
#: filesystems a file deleted by another node can turn a mapped page into SIGBUS.
LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "bcachefs", "ramfs"}


def filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem holding ``path`` (from /proc/self/mounts), or None if unknown."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return None
    path = os.path.realpath(path)
    best, fstype = "", None
    for mountpoint, kind in mounts:
        mountpoint = mountpoint.replace("\\040", " ")
        if (path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")) and len(mountpoint) >= len(best):
            best, fstype = mountpoint, kind
    return fstype


class LocalStorage(Storage):
    """A local or shared POSIX filesystem: fsync'd files and directories, atomic rename."""

    atomic_rename = True

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        probe = self.root
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        self.mappable = filesystem_type(probe) in LOCAL_FILESYSTEMS

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> List[str]:
        return sorted(os.listdir(path))

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def mkdirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb", buffering=0)

    def open_write(self, path: str) -> IO[bytes]:
        return open(path, "wb", buffering=0)

    def finish_write(self, f: IO[bytes]) -> None:
        f.flush()
        os.fsync(f.fileno())

    def remove_tree(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    def rename_dir(self, src: str, dst: str) -> None:
        # os.rename would silently replace an empty dst; refuse any existing one.
        if os.path.exists(dst):
            raise FileExistsError(errno.EEXIST, "destination exists", dst)
        os.rename(src, dst)

    def move_file(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class FsspecStorage(Storage):
    """Any fsspec filesystem (s3://, gs://, memory://, ...). No atomic rename: the commit
    moves the shards into place first and writes ``metadata.json`` last, so a directory
    without it is incomplete exactly as on a local disk."""

    atomic_rename = False

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self._protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol

    def display(self, path: str) -> str:
        return f"{self._protocol}://{path.lstrip('/')}" if "://" not in path else path

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(path))

    def listdir(self, path: str) -> List[str]:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def mkdirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> IO[bytes]:
        return RangeReader(self.fs, path)  # type: ignore[return-value]

    def open_write(self, path: str) -> IO[bytes]:
        return self.fs.open(path, "wb")

    def finish_write(self, f: IO[bytes]) -> None:
        f.flush()

    def remove_tree(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def rename_dir(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst, recursive=True)

    def move_file(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst)

    def sync_dir(self, path: str) -> None:
        return None


class RangeReader:
    """A read-only file over fsspec's stateless ranged reads (``cat_file``): one request per
    ``readinto``, safe to use from several threads at once (each has its own position)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path, self.pos = fs, path, 0
        if not fs.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else int(self.fs.size(self.path)) + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = None if n is None or n < 0 else self.pos + n
        data = bytes(self.fs.cat_file(self.path, start=self.pos, end=end))
        self.pos += len(data)
        return data

    def readinto(self, view: Any) -> int:
        data = self.read(len(memoryview(view).cast("B")))
        memoryview(view).cast("B")[: len(data)] = data
        return len(data)

    def close(self) -> None:
        return None

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_CACHE: Dict[Tuple[str, str], Storage] = {}
StorageFactory = Callable[[str, Dict[str, Any]], Storage]
_REGISTRY: Dict[str, Union[StorageFactory, Storage]] = {}


def register_storage(scheme: str, backend: Union[StorageFactory, Storage]) -> None:
    """Use ``backend`` for roots ``<scheme>://...``: a ready :class:`Storage` instance, or a factory
    called with ``(root, storage_options)``. It takes precedence over fsspec for that scheme."""
    if not isinstance(backend, Storage) and not callable(backend):
        raise TypeError(f"register_storage({scheme!r}, ...): give a Storage instance or a factory")
    _REGISTRY[scheme.rstrip(":/")] = backend


def get_storage(
    root: Union[str, os.PathLike, Storage], storage_options: Optional[Dict[str, Any]] = None
) -> Storage:
    """The backend for ``root``: a :class:`Storage` instance as is; plain paths and ``file://`` are
    local; a scheme given to :func:`register_storage` uses its backend; other URLs go through fsspec."""
    if isinstance(root, Storage):
        return root
    if not isinstance(root, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint root must be a path or URL, got {type(root).__name__}")
    root = os.fspath(root)
    if not root:
        raise CheckpointError("checkpoint root is empty: pass a directory or URL")
    if "://" not in root:
        return LocalStorage(root)
    registered = _REGISTRY.get(root.split("://", 1)[0])
    if registered is not None:
        return registered if isinstance(registered, Storage) else registered(root, dict(storage_options or {}))
    if root.startswith("file://") and not storage_options:
        return LocalStorage(root[len("file://"):])
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise CheckpointError(f"{root}: remote checkpoint roots need `pip install fsspec`") from None
    del fsspec
    key = (root, repr(sorted((storage_options or {}).items())))
    if key not in _CACHE:
        try:
            fs, path = url_to_fs(root, **(storage_options or {}))
        except (ImportError, ValueError) as err:
            raise CheckpointError(f"cannot open checkpoint root {root}: {err}") from None
        _CACHE[key] = FsspecStorage(fs, path, root)
    return _CACHE[key]
