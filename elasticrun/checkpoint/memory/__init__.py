"""The memory tier: checkpoints in the node's shared memory, replicated to a peer node.

Part of the checkpoint layer; imports the disk core of :mod:`elasticrun.checkpoint` (the
format, the writer, the commit) and :mod:`elasticrun.job` (the shared-memory layout,
:mod:`elasticrun.job.shm`), never the other way round.

- :mod:`~.snapshotter`: :class:`Snapshotter` / :func:`snapshot`, writing generations;
- :mod:`~.budget`: whether a node's share fits in shared memory and under the cap;
- :mod:`~.commit`: the per-node commit of a generation and its retention;
- :mod:`~.pinned`: async snapshots through reused (pinned) host buffers;
- :mod:`~.replicas`: the copy of each node's parts to the next node;
- :mod:`~.persist`: every K-th generation copied to disk;
- :mod:`~.restore` and :mod:`~.fetch`: what the job's memory holds, and bringing the files a
  node reads onto it at any world size (parts missing on a node are fetched from peers);
- :mod:`~.load` and :mod:`~.integrity`: loading a generation with every byte checked as it is
  copied (a changed copy is replaced by a peer's, or the restore fails).

The names below are what the rest of elasticrun (``elasticrun.train``) uses; they are
imported lazily (most need torch).
"""

from __future__ import annotations

from elasticrun.checkpoint.lazy import lazy_exports

_LAZY = {
    "Snapshotter": "elasticrun.checkpoint.memory.snapshotter",
    "snapshot": "elasticrun.checkpoint.memory.snapshotter",
    "SnapshotMemoryError": "elasticrun.checkpoint.memory.budget",
    "SnapshotUnavailable": "elasticrun.checkpoint.memory.budget",
    "ResumedCheckpoint": "elasticrun.checkpoint.memory.restore",
    "Tier": "elasticrun.checkpoint.memory.restore",
    "candidates": "elasticrun.checkpoint.memory.restore",
    "drop_newer_generations": "elasticrun.checkpoint.memory.restore",
    "mark_failed": "elasticrun.checkpoint.memory.restore",
    "load_generation": "elasticrun.checkpoint.memory.load",
    "materialize": "elasticrun.checkpoint.memory.fetch",
    "release": "elasticrun.checkpoint.memory.fetch",
}


__getattr__ = lazy_exports(__name__, _LAZY, globals())


__all__ = ["ResumedCheckpoint", "SnapshotMemoryError", "SnapshotUnavailable", "Snapshotter", "Tier", "candidates",
           "drop_newer_generations", "load_generation", "mark_failed", "materialize", "release", "snapshot"]
