"""Resume from the newest loadable checkpoint, telling "nothing saved yet" from "broken".

``elasticrun.checkpoint.load(root, "latest")`` raises the same :class:`CheckpointError`
for an empty directory and for a corrupt checkpoint. A training script needs to tell
them apart: the first means "start from scratch", the second must not silently throw
away progress. :func:`load_latest` returns ``None`` only when there is no complete
checkpoint at all; otherwise it loads the newest one, and with ``fallback=True`` (the
default) steps back to older complete checkpoints, logging a warning for each one it
skips, so a job does not crash-loop on one damaged checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

import torch.distributed as dist

from elasticrun.errors import CheckpointError

if TYPE_CHECKING:
    from elasticrun.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)


def complete_checkpoints(root: str, process_group: Any = None) -> List[str]:
    """Names of the complete checkpoints under ``root``, newest first, as rank 0 sees them
    (collective when a process group exists, so every rank gets the same list)."""
    from elasticrun.checkpoint import list_checkpoints

    names: List[str] = []
    error: Optional[str] = None
    is_dist = dist.is_available() and dist.is_initialized()
    if not is_dist or dist.get_rank(process_group) == 0:
        try:
            names = [i.name for i in reversed(list_checkpoints(root)) if i.status == "complete"]
        except CheckpointError as err:
            error = str(err)
    if is_dist and dist.get_world_size(process_group) > 1:
        box: List[Any] = [(names, error)]
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        dist.broadcast_object_list(box, src=src, group=process_group)
        names, error = box[0]
    if error is not None:
        raise CheckpointError(error)
    return names


def load_latest(
    root: str,
    *,
    state_dict: Optional[Dict[str, Any]] = None,
    placements: Optional[Mapping[str, Any]] = None,
    process_group: Any = None,
    fallback: bool = True,
) -> Optional[LoadedCheckpoint]:
    """Load the newest complete checkpoint under ``root`` (collective), or ``None`` if there is none.

    Arguments are those of :func:`elasticrun.checkpoint.load`. Raises
    :class:`CheckpointError` when checkpoints exist but none can be loaded (or the newest
    cannot, with ``fallback=False``).
    """
    from elasticrun.checkpoint import load

    names = complete_checkpoints(root, process_group)
    if not names:
        return None
    failures = []
    for name in names if fallback else names[:1]:
        try:
            return load(root, name, state_dict=state_dict, placements=placements, process_group=process_group)
        except CheckpointError as err:  # raised on every rank alike, so all ranks move on together
            failures.append(f"{name}: {err}")
            if fallback and len(failures) < len(names):
                log.warning("checkpoint %s cannot be loaded (%s); trying the previous one", name, err)
    raise CheckpointError(
        f"no checkpoint under {root} could be loaded ({len(failures)} tried); newest: {failures[0]}"
    )


__all__ = ["complete_checkpoints", "load_latest"]
