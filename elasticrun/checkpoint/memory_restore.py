"""Which checkpoint to resume from when there are two tiers: memory snapshots and disk.

:func:`candidates` (collective) lists the complete checkpoints of both tiers as rank 0 sees
them, newest training step first; at equal steps the memory generation comes first (it
loads faster). ``elasticrun.train.load_latest`` tries them in that order, so a torn or
damaged generation falls back to the previous one, then to disk.
"""

from __future__ import annotations

import enum
import os
import shutil
from dataclasses import dataclass, fields
from typing import Any, List, Optional, Tuple

from elasticrun.checkpoint.memory import generations_root
from elasticrun.checkpoint.reader import LoadedCheckpoint
from elasticrun.job import env as env_names


class Tier(str, enum.Enum):
    """Where a checkpoint lives."""

    MEMORY = "memory"
    DISK = "disk"


@dataclass
class ResumedCheckpoint(LoadedCheckpoint):
    """A :class:`LoadedCheckpoint` plus the tier and root it was loaded from."""

    tier: str = Tier.DISK.value
    root: str = ""

    @classmethod
    def of(cls, ckpt: LoadedCheckpoint, tier: Tier, root: str) -> ResumedCheckpoint:
        return cls(**{f.name: getattr(ckpt, f.name) for f in fields(LoadedCheckpoint)}, tier=tier.value, root=root)


def _list(root: str, tier: Tier) -> List[Tuple[int, int, int, Tier, str, str]]:
    from elasticrun.checkpoint import list_checkpoints

    infos = [i for i in list_checkpoints(root) if i.status == "complete" and i.meta is not None and i.alias_of is None]
    out = []
    for pos, info in enumerate(infos):  # oldest first
        step = info.meta.step if info.meta is not None and info.meta.step is not None else -1
        out.append((step, 1 if tier is Tier.MEMORY else 0, pos, tier, root, info.name))
    return out


def candidates(disk_root: str, process_group: Any = None, memory: bool = True) -> List[Tuple[Tier, str, str]]:
    """``[(tier, root, name)]`` of every complete checkpoint of both tiers, newest first
    (collective when torch.distributed is initialised: every rank gets rank 0's list)."""
    from elasticrun.checkpoint.comm import on_rank0

    def scan_both() -> List[Tuple[Tier, str, str]]:
        rows = _list(disk_root, Tier.DISK)
        mem = generations_root() if memory else None
        if mem is not None and os.path.isdir(mem):
            rows += _list(mem, Tier.MEMORY)
        return [(tier, root, name) for _s, _t, _p, tier, root, name in sorted(rows, reverse=True)]

    return on_rank0(scan_both, process_group)


def drop_newer_generations(step: Optional[int]) -> List[str]:
    """After resuming at ``step``: remove this node's memory generations of later steps (they
    belong to a timeline the job just abandoned, e.g. when their parts on another node were
    gone). Done by local rank 0 only; returns the names removed."""
    if os.environ.get(env_names.LOCAL_RANK, "0") != "0" or step is None:
        return []
    root = generations_root()
    if root is None or not os.path.isdir(root):
        return []
    from elasticrun.checkpoint import list_checkpoints

    removed = []
    for info in list_checkpoints(root):
        if info.status == "complete" and info.meta is not None and (info.meta.step or -1) > step:
            shutil.rmtree(os.path.join(root, info.dirname), ignore_errors=True)
            removed.append(info.name)
    return removed


__all__ = ["ResumedCheckpoint", "Tier", "candidates", "drop_newer_generations"]
