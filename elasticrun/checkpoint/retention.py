"""Deleting checkpoints: by name, by retention policy (keep the newest K), or the incomplete ones.

A deletion first removes ``metadata.json`` (un-committing the checkpoint, so a crash
midway leaves an *incomplete* directory, never a half-readable "complete" one), then the
rest. Retention never deletes the newest complete checkpoint, the one just written, or
anything that is not complete (a save in progress looks incomplete).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

from elasticrun.checkpoint.format import METADATA_FILE, validate_name
from elasticrun.checkpoint.storage import Storage, get_storage, retry
from elasticrun.checkpoint.validate import COMPLETE, CheckpointInfo, scan
from elasticrun.errors import CheckpointError

log = logging.getLogger(__name__)


def remove_entry(storage: Storage, dirname: str) -> None:
    """Delete one directory of the root: commit marker first, then everything else."""
    path = storage.join(dirname)
    marker = f"{path}/{METADATA_FILE}"
    if retry(lambda: storage.exists(marker), f"check {storage.display(marker)}"):
        retry(lambda: storage.remove_tree(marker), f"delete {storage.display(marker)}")
    retry(lambda: storage.remove_tree(path), f"delete {storage.display(path)}")


def plan_keep_last(infos: Sequence[CheckpointInfo], keep_last: int, protect: Optional[str] = None) -> List[str]:
    """Names of complete checkpoints beyond the newest ``keep_last`` (never the latest or ``protect``)."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1 (got {keep_last}): the newest checkpoint is always kept")
    complete = [i for i in infos if i.status == COMPLETE and not i.temporary]
    old = complete[:-keep_last] if len(complete) > keep_last else []
    return [i.name for i in old if not i.latest and i.name != protect]


def apply_keep_last(storage: Storage, keep_last: int, protect: Optional[str] = None) -> List[str]:
    """Delete the complete checkpoints beyond the newest ``keep_last``; returns the names deleted."""
    doomed = plan_keep_last(scan(storage), keep_last, protect)
    for name in doomed:
        log.info("retention: deleting checkpoint %s", name)
        remove_entry(storage, name)
    return doomed


def delete(
    root: str,
    names: Sequence[str],
    *,
    force: bool = False,
    storage_options: Optional[Dict[str, Any]] = None,
) -> List[str]:
    """Delete the named checkpoints under ``root`` (complete, incomplete or corrupt).

    Refuses names that are not plain checkpoint names (nothing outside ``root`` can be
    touched) and, unless ``force``, deleting every complete checkpoint there is.
    Returns the names deleted. Temporary directories are deleted by their directory name.
    """
    storage = get_storage(root, storage_options)
    infos = {i.dirname: i for i in scan(storage)}
    targets = []
    for name in names:
        if name in infos and infos[name].temporary:
            targets.append(name)
            continue
        validate_name(name)
        if name not in infos:
            raise CheckpointError(f"no checkpoint {name!r} in {storage.display(storage.root)}: nothing deleted")
        targets.append(name)
    remaining = [i for d, i in infos.items() if i.status == COMPLETE and d not in targets]
    doomed_complete = [d for d in targets if infos[d].status == COMPLETE]
    if doomed_complete and not remaining and not force:
        raise CheckpointError(
            f"refusing to delete {', '.join(doomed_complete)}: no complete checkpoint would be left in "
            f"{storage.display(storage.root)}; pass --force (force=True) if you mean it"
        )
    for d in targets:
        remove_entry(storage, d)
    return targets
