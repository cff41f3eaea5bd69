"""Sharded safetensors checkpoints: atomic commit, resharding on load, async save, retention.

    from elasticrun.checkpoint import save, load, Shard
    name = save(state, "ckpts", training_state=ts, placements={"emb.weight": Shard(0)}, keep_last=3)
    ckpt = load("ckpts", "latest", state_dict=state)   # any world size

The names that need torch (save/load/async) are imported lazily, so listing and
verifying checkpoints (the CLI's read commands) start without importing torch.
See docs/checkpoints.md for the format.
"""

from __future__ import annotations

from elasticrun.checkpoint.checksum import Checksum
from elasticrun.checkpoint.format import LATEST, CheckpointMeta, Replicate, Shard
from elasticrun.checkpoint.lazy import lazy_exports
from elasticrun.checkpoint.retention import delete
from elasticrun.checkpoint.validate import CheckpointInfo, CheckpointStatus, VerifyResult, list_checkpoints, verify
from elasticrun.errors import CheckpointError

_LAZY = {
    "save": "elasticrun.checkpoint.writer",
    "load": "elasticrun.checkpoint.reader",
    "LoadedCheckpoint": "elasticrun.checkpoint.reader",
    "async_save": "elasticrun.checkpoint.background",
    "AsyncCheckpointer": "elasticrun.checkpoint.background",
    "AsyncSaveHandle": "elasticrun.checkpoint.background",
    "wait_async_saves": "elasticrun.checkpoint.background",
    "snapshot": "elasticrun.checkpoint.memory.snapshotter",
    "Snapshotter": "elasticrun.checkpoint.memory.snapshotter",
    "SnapshotMemoryError": "elasticrun.checkpoint.memory.budget",
    "SnapshotUnavailable": "elasticrun.checkpoint.memory.budget",
}


__getattr__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "LATEST",
    "AsyncCheckpointer",
    "AsyncSaveHandle",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStatus",
    "CheckpointMeta",
    "Checksum",
    "LoadedCheckpoint",
    "Replicate",
    "Shard",
    "SnapshotMemoryError",
    "SnapshotUnavailable",
    "Snapshotter",
    "VerifyResult",
    "async_save",
    "delete",
    "list_checkpoints",
    "load",
    "save",
    "snapshot",
    "verify",
    "wait_async_saves",
]
