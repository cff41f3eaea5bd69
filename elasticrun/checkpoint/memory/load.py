"""Loading a memory generation, every byte checked as it is copied.

:func:`load_generation` (collective) is what ``load_latest`` does with a memory candidate.
:func:`~.fetch.materialize` brings the files each node's ranks read onto the node; the normal
reader (:func:`elasticrun.checkpoint.load`, at any world size, into the caller's state dict or
into fresh tensors) reads them through a :class:`~.integrity.CheckedRoot`, which hashes every
block right after it is copied; each rank then hashes the rest of the files it read and the
ranks exchange what failed.

A copy that failed was loaded: its bytes are in the tensors. They are never returned: the
generation is loaded a second time with the failed copies replaced by another node's (fetched
over the process group, checked on receipt), which overwrites every tensor; when no node has
a good copy, or a file fails again, a :class:`CheckpointError` is raised on every rank alike
and ``load_latest`` loads the next checkpoint into the same tensors. (Should no checkpoint load
at all, ``load_latest`` raises, and the state dict holds whatever was read last.) Checking after
the copy instead of before is what keeps a restore at memory speed: one pass over the bytes.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta
from elasticrun.checkpoint.memory.fetch import materialize, release
from elasticrun.checkpoint.memory.integrity import CheckedRoot
from elasticrun.checkpoint.reader import LoadedCheckpoint, load
from elasticrun.checkpoint.storage import describe
from elasticrun.checkpoint.tree import flatten
from elasticrun.errors import CheckpointError

log = logging.getLogger(__name__)


def _read_checked(root: CheckedRoot, name: str, state_dict: Optional[Dict[str, Any]],
                  placements: Optional[Mapping[str, Any]],
                  process_group: Any) -> Tuple[Optional[LoadedCheckpoint], Optional[str], Dict[str, str]]:
    """One load through ``root``: ``(checkpoint or None, error or None, {file: why it failed})``."""
    ckpt: Optional[LoadedCheckpoint] = None
    error: Optional[str] = None
    try:
        ckpt = load(root, name, state_dict=state_dict, placements=placements, process_group=process_group,
                    verify=False, mmap=False)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - every rank must still reach the exchange
        error = f"memory snapshot {name!r} could not be loaded: {describe(err)}"
    meta = ckpt.meta if ckpt is not None else None
    if meta is None:  # the load failed: were the bytes it read changed?
        try:
            with open(os.path.join(root.root, name, METADATA_FILE), "rb") as f:
                meta = CheckpointMeta.loads(f.read(), f"memory snapshot {name}")
        except Exception:  # noqa: BLE001 - no metadata: nothing to check against; the error stands
            meta = None
    return ckpt, error, root.failures(meta) if meta is not None else {}


def load_generation(name: str, state_dict: Optional[Dict[str, Any]] = None,
                    placements: Optional[Mapping[str, Any]] = None,
                    process_group: Any = None) -> Tuple[LoadedCheckpoint, Dict[str, int]]:
    """Load memory generation ``name`` (collective; arguments as for
    :func:`elasticrun.checkpoint.load`); returns the checkpoint and what this node fetched from
    peers (``{"files": n, "bytes": b}``). Every byte loaded matched its checksum; raises
    :class:`CheckpointError` on every rank alike otherwise (see the module doc)."""
    comm = Comm(process_group)
    names = list(flatten(state_dict)[0]) if state_dict is not None else None
    corrupt: Optional[List[List[str]]] = None
    fetched = {"files": 0, "bytes": 0}
    for attempt in (1, 2):
        where, got = materialize(name, process_group, names, placements, corrupt)
        fetched = {k: fetched[k] + got[k] for k in fetched}
        root = CheckedRoot(where)
        try:
            ckpt, error, failed = _read_checked(root, name, state_dict, placements, process_group)
        finally:
            root.close()
            release(name)
        for fname, why in sorted(failed.items()):
            log.warning("memory snapshot %s: %s on this node fails its checksum (%s: changed in shared memory after "
                        "it was written)%s", name, fname, why,
                        "; loading it from another node" if attempt == 1 else "")
        results = comm.all_gather({"failed": sorted(failed), "error": error})
        corrupt = [r["failed"] for r in results]
        if not any(corrupt):
            first = next((r["error"] for r in results if r["error"]), None)
            if first is not None:
                raise CheckpointError(first)
            assert ckpt is not None
            return ckpt, fetched
    bad = next(f for files in corrupt or [] for f in files)
    raise CheckpointError(f"memory snapshot {name!r}: {bad} fails its checksum again after it was loaded from "
                          "another node")


__all__ = ["load_generation"]
