"""Deleting checkpoints: by name, by retention policy (keep the newest K), or the incomplete ones.

A deletion first removes ``metadata.json`` (un-committing the checkpoint, so a crash
midway leaves an *incomplete* directory, never a half-readable "complete" one), then the
rest. Nothing here follows a symbolic link: deleting an alias (``best -> step-N``)
removes the link only, and a link inside a checkpoint is removed, never its target.

Retention keeps the newest ``K`` complete checkpoints (by training step, then commit
sequence: never by a clock) and never deletes the latest one, the one just written, a
checkpoint an alias in the root points to, or anything that is not complete (a save in
progress looks incomplete). :func:`reclaim_stale_temps` removes the temporary
directories of saves whose writer is dead (a full disk calls it before retrying).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from typing import Any, Dict, List, Optional, Sequence

from elasticrun.checkpoint.format import METADATA_FILE, validate_name
from elasticrun.checkpoint.storage import LocalStorage, Storage, get_storage, retry
from elasticrun.checkpoint.validate import CheckpointInfo, CheckpointStatus, is_ordered, scan
from elasticrun.errors import CheckpointError

log = logging.getLogger(__name__)


def _remove_local(path: str) -> None:
    """Remove one entry of a local root without following any symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):  # a symlink (an alias) or a stray file: the entry itself only
        os.unlink(path)
        return
    marker = os.path.join(path, METADATA_FILE)
    try:
        if not stat.S_ISDIR(os.lstat(marker).st_mode):
            os.unlink(marker)  # un-commit first; a symlinked marker loses the link, not its target
    except FileNotFoundError:
        pass
    shutil.rmtree(path)  # never follows symlinks inside the tree


def remove_entry(storage: Storage, dirname: str) -> None:
    """Delete one entry of the root: commit marker first, then everything else; a link only unlinks."""
    path = storage.join(dirname)
    if isinstance(storage, LocalStorage):
        retry(lambda: _remove_local(path), f"delete {storage.display(path)}")
        return
    marker = f"{path}/{METADATA_FILE}"
    if retry(lambda: storage.exists(marker), f"check {storage.display(marker)}"):
        retry(lambda: storage.remove_tree(marker), f"delete {storage.display(marker)}")
    retry(lambda: storage.remove_tree(path), f"delete {storage.display(path)}")


def alias_targets(infos: Sequence[CheckpointInfo]) -> Dict[str, List[str]]:
    """Checkpoint name -> the aliases in the root that point to it."""
    out: Dict[str, List[str]] = {}
    for i in infos:
        if i.alias_of is not None:
            out.setdefault(i.alias_of, []).append(i.dirname)
    return out


def plan_keep_last(infos: Sequence[CheckpointInfo], keep_last: int, protect: Optional[str] = None) -> List[str]:
    """Names of complete checkpoints beyond the newest ``keep_last`` (never the latest, ``protect``,
    an alias or a checkpoint an alias points to)."""
    if not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1 (got {keep_last}): the newest checkpoint is always kept")
    complete = [i for i in infos if is_ordered(i)]
    complete.sort(key=lambda i: i.order_key())
    aliased = alias_targets(infos)
    old = complete[:-keep_last] if len(complete) > keep_last else []
    return [i.name for i in old if not i.latest and i.name != protect and i.dirname not in aliased]


def apply_keep_last(storage: Storage, keep_last: int, protect: Optional[str] = None) -> List[str]:
    """Delete the complete checkpoints beyond the newest ``keep_last``; returns the names deleted."""
    doomed = plan_keep_last(scan(storage), keep_last, protect)
    for name in doomed:
        log.info("retention: deleting checkpoint %s", name)
        remove_entry(storage, name)
    return doomed


def plan_delete(infos: Sequence[CheckpointInfo], names: Sequence[str], where: str, *, force: bool = False,
                force_hint: str = "force=True") -> List[str]:
    """What deleting ``names`` from a root whose entries are ``infos`` removes (``where`` names the
    root in errors), or a CheckpointError saying why nothing is deleted: a name that is not a plain
    checkpoint name or is not there, and, unless ``force``, a checkpoint an alias that stays points
    to, or the last complete checkpoint. A temporary directory is named by its directory name."""
    by_dir = {i.dirname: i for i in infos}
    targets = []
    for name in names:
        if name not in by_dir or not by_dir[name].temporary:
            validate_name(name)
        if name not in by_dir:
            raise CheckpointError(f"no checkpoint {name!r} in {where}: nothing deleted")
        targets.append(name)
    if not force:
        _refuse_dangling_aliases(list(by_dir.values()), targets, force_hint)
        _refuse_last_complete(by_dir, targets, where, force_hint)
    return targets


def _refuse_dangling_aliases(infos: Sequence[CheckpointInfo], targets: Sequence[str], force_hint: str) -> None:
    aliased = alias_targets(infos)
    for d in targets:
        links = [a for a in aliased.get(d, []) if a not in targets]
        if links:
            raise CheckpointError(
                f"refusing to delete {d}: the alias(es) {', '.join(links)} point to it; delete them too, or "
                f"pass {force_hint} to leave them dangling"
            )


def _refuse_last_complete(by_dir: Dict[str, CheckpointInfo], targets: Sequence[str], where: str,
                          force_hint: str) -> None:
    remaining = [i for d, i in by_dir.items() if is_ordered(i) and d not in targets]
    doomed = [d for d in targets if by_dir[d].status == CheckpointStatus.COMPLETE and by_dir[d].alias_of is None]
    if doomed and not remaining:
        raise CheckpointError(
            f"refusing to delete {', '.join(doomed)}: no complete checkpoint would be left in {where}; "
            f"pass {force_hint} if you mean it"
        )


def delete(
    root: str,
    names: Sequence[str],
    *,
    force: bool = False,
    storage_options: Optional[Dict[str, Any]] = None,
    force_hint: str = "force=True",
) -> List[str]:
    """Delete the named checkpoints under ``root`` (complete, incomplete, corrupt, or aliases).

    Refuses names that are not plain checkpoint names (nothing outside ``root`` can be
    touched) and, unless ``force``, deleting every complete checkpoint there is or a
    checkpoint that an alias points to (see :func:`plan_delete`). Deleting an alias removes
    the link only. Returns the names deleted. Temporary directories are deleted by their
    directory name. ``force_hint`` is how a refusal names the override (the CLI: ``--force``).
    """
    storage = get_storage(root, storage_options)
    targets = plan_delete(scan(storage), names, storage.display(storage.root), force=force, force_hint=force_hint)
    for d in targets:
        remove_entry(storage, d)
    return targets


def incomplete_targets(infos: Sequence[CheckpointInfo]) -> List[str]:
    """What ``--incomplete`` deletes: this format's temporary, incomplete or corrupt directories only
    (never an alias, never a directory this format did not write, such as ``configs/``)."""
    return [i.dirname for i in infos if i.status != CheckpointStatus.COMPLETE and i.ours and i.alias_of is None]
