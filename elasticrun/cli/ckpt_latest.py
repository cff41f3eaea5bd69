"""Which checkpoint ``latest`` is, and which newer entries it skipped (and why), for ``elasticrun ckpt``.

``latest`` is the newest *complete* checkpoint (docs/checkpoints.md, Ordering). A newer entry
that is damaged (a truncated file, unreadable metadata) is never used, and a command that
takes ``latest`` says so: which entry it skipped and what is wrong with it, so that a
corrupt newest checkpoint is never passed over without a word.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from elasticrun.checkpoint.format import LATEST
from elasticrun.checkpoint.storage import Storage
from elasticrun.checkpoint.validate import CheckpointInfo, CheckpointStatus, resolve_name, scan


def skipped_newer(infos: List[CheckpointInfo]) -> List[CheckpointInfo]:
    """The damaged entries that ``latest`` passed over: corrupt checkpoints (not aliases, not a save in
    progress) ordered above the newest complete one, or whose metadata cannot be read (unordered)."""
    latest = next((i for i in infos if i.latest), None)
    found = []
    for info in infos:
        if info.status != CheckpointStatus.CORRUPT or info.alias_of is not None or info.temporary:
            continue
        if info.meta is None or latest is None or info.order_key() > latest.order_key():
            found.append(info)
    return found


def skip_line(info: CheckpointInfo, latest: Optional[str]) -> str:
    """One line: what was skipped, why, and what is used instead."""
    instead = f"; using {latest}" if latest else ""
    return f"skipped {info.name}, newer than the latest complete checkpoint: {info.problem or 'damaged'}{instead}"


def resolve(storage: Storage, name: str, warn: Callable[[str], None]) -> str:
    """``name``, or for ``latest`` the newest complete checkpoint's name, after one ``warn`` line per
    damaged newer entry skipped. CheckpointError when there is none."""
    if name != LATEST:
        return resolve_name(storage, name)
    infos = scan(storage)
    latest = next((i.name for i in infos if i.latest), None)
    for info in skipped_newer(infos):
        warn(skip_line(info, latest))
    return latest if latest is not None else resolve_name(storage, name)  # none: its one-line error


__all__ = ["resolve", "skip_line", "skipped_newer"]
