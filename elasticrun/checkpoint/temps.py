"""Temporary directories of saves: the writer's marker file, and reclaiming those of dead saves.

Every save writes into ``<root>/.<name>.tmp-<token>/`` and first creates
``.elasticrun-incomplete`` there, holding who writes it (host, boot id, pid, start time).
A crashed save leaves that directory behind. :func:`reclaim_stale_temps` removes the ones
whose writer is provably dead (same host and boot, pid gone) or that are older than
``max_age`` seconds (any host: the age comes from the directory's mtime). A full disk
during a save calls it (and retention) before the one retry. Under elasticrun the marker also
names the job and round, and :func:`fence_older_saves` takes older rounds' saves out of reach
of their commit (the storage side of the commit fence, :mod:`elasticrun.job.fence`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from typing import Any, Dict, List, Optional

from elasticrun.checkpoint.format import INCOMPLETE_MARKER, parse_tmp_dir_name
from elasticrun.checkpoint.storage import LocalStorage, Storage, describe, retry
from elasticrun.job.fence import fence_identity
from elasticrun.proc import pid_alive

log = logging.getLogger(__name__)

#: Appended to the name of a temporary directory that a newer round fenced (still a temporary
#: directory's name: listed as incomplete, reclaimed like one).
FENCED_SUFFIX = "-fenced"

#: A temporary directory older than this (seconds since its last change) is reclaimed even when
#: its writer's liveness cannot be checked (another host).
STALE_TEMP_AGE = 6 * 3600.0


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def writer_identity() -> Dict[str, Any]:
    """What the marker file records about the process writing a save (under elasticrun also its
    job and round, for :func:`fence_older_saves`)."""
    who: Dict[str, Any] = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                           "started": time.time()}
    fenced = fence_identity()
    if fenced is not None:
        who["job"], who["round"] = fenced
    return who


def write_marker(storage: Storage, tmp: str) -> None:
    """Create the marker file in the temporary directory ``tmp`` (best effort durability)."""
    storage.write_bytes(f"{tmp}/{INCOMPLETE_MARKER}", json.dumps(writer_identity()).encode())


def drop_marker(storage: Storage, path: str) -> None:
    """Remove the marker after the commit (a leftover one is harmless: metadata.json wins)."""
    try:
        storage.remove_tree(f"{path}/{INCOMPLETE_MARKER}")
    except Exception as err:  # noqa: BLE001 - never fail a committed save for this
        log.debug("could not remove %s/%s: %s", path, INCOMPLETE_MARKER, describe(err))


def _read_marker(storage: Storage, tmp: str) -> Optional[Dict[str, Any]]:
    from elasticrun.checkpoint.validate import read_small_file

    try:
        d = json.loads(read_small_file(storage, f"{tmp}/{INCOMPLETE_MARKER}", 64 << 10))
    except Exception:  # noqa: BLE001 - absent, unreadable or hostile: no identity
        return None
    return d if isinstance(d, dict) else None


def _age(storage: Storage, path: str) -> float:
    if isinstance(storage, LocalStorage):
        try:
            return time.time() - os.lstat(path).st_mtime
        except OSError:
            return 0.0
    return 0.0  # object stores: no reliable mtime for prefixes; only the liveness rule applies


def is_stale(storage: Storage, tmp: str, max_age: float = STALE_TEMP_AGE) -> bool:
    """Whether the temporary directory ``tmp`` belongs to a save that is certainly over."""
    marker = _read_marker(storage, tmp)
    if marker is not None and marker.get("host") == socket.gethostname() and marker.get("boot_id") == _boot_id():
        pid = marker.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and pid != os.getpid():
            if not pid_alive(pid):
                return True
    return _age(storage, tmp) > max_age


def reclaim_stale_temps(storage: Storage, exclude: Optional[str] = None,
                        max_age: float = STALE_TEMP_AGE) -> List[str]:
    """Remove the temporary directories of dead saves in the root (never ``exclude``, a directory
    name); returns the names removed."""
    from elasticrun.checkpoint.retention import remove_entry

    removed = []
    try:
        names = retry(lambda: storage.listdir(storage.root), f"list {storage.display(storage.root)}")
    except Exception as err:  # noqa: BLE001
        log.warning("cannot list %s to reclaim temporary directories: %s", storage.root, err)
        return removed
    for dirname in names:
        if dirname == exclude or parse_tmp_dir_name(dirname) is None:
            continue
        path = storage.join(dirname)
        try:
            if not storage.isdir(path) or (isinstance(storage, LocalStorage) and os.path.islink(path)):
                continue
            if is_stale(storage, path, max_age):
                remove_entry(storage, dirname)
                removed.append(dirname)
                log.warning("removed %s: the temporary directory of a save that is over", storage.display(path))
        except Exception as err:  # noqa: BLE001 - reclaiming is best effort
            log.warning("could not reclaim %s: %s", storage.display(path), err)
    return removed


def fence_older_saves(storage: Storage) -> List[str]:
    """Under elasticrun, on a root with atomic renames: rename aside (then remove) the temporary
    directories of this job's saves of older rounds; returns their names.

    A newer round's rank 0 calls this when it opens the root (a save, a load of "latest", a
    resume). A save of an older round that already passed its commit check but had not yet
    renamed its directory into place (its process frozen there) then finds it gone and is not
    committed: the rename of the save and this one are atomic, exactly one of them wins. A save
    whose rename won was complete and checked before the round changed; it is visible to this
    round like any checkpoint committed a moment earlier."""
    who = fence_identity()
    if who is None or not storage.atomic_rename:
        return []
    job, current = who
    try:
        names = retry(lambda: storage.listdir(storage.root), f"list {storage.display(storage.root)}")
    except Exception as err:  # noqa: BLE001 - a root that cannot be listed fails the save or load itself
        log.debug("cannot list %s to fence older saves: %s", storage.display(storage.root), describe(err))
        return []
    fenced = []
    for dirname in names:
        if parse_tmp_dir_name(dirname) is None or dirname.endswith(FENCED_SUFFIX):
            continue
        marker = _read_marker(storage, storage.join(dirname))
        owner, round_ = (marker or {}).get("job"), (marker or {}).get("round")
        if owner != job or not isinstance(round_, int) or isinstance(round_, bool) or round_ >= current:
            continue
        aside = dirname + FENCED_SUFFIX
        try:
            storage.rename_dir(storage.join(dirname), storage.join(aside))
        except OSError:
            continue  # committed (or fenced by someone else) just now
        fenced.append(dirname)
        log.warning("fenced %s: a save of round %d, older than this round (%d), can no longer be committed",
                    storage.display(storage.join(dirname)), round_, current)
        from elasticrun.checkpoint.retention import remove_entry

        try:
            remove_entry(storage, aside)
        except Exception as err:  # noqa: BLE001 - a leftover is listed as incomplete, and reclaimed later
            log.debug("could not remove %s: %s", storage.display(storage.join(aside)), describe(err))
    return fenced


def is_disk_full(err: Optional[BaseException]) -> bool:
    """Whether an error (or its cause) is ENOSPC/EDQUOT: the disk (or quota) is full."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
        seen += 1
    return False
