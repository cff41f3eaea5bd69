"""The memory tier's space budget: does a node's share of the snapshots fit in shared memory?

A node holds, per generation, the parts its ranks write plus (on several nodes) a replica of
its ring predecessor's parts; :func:`plan_memory` sizes that on every rank, collectively, and
checks it against the node's free shared memory and the cap: ``--snapshot-memory``
(``ELASTICRUN_SNAPSHOT_MEMORY``, a size as :func:`elasticrun.sizes.parse_size` reads it), or
the default cap of :mod:`~.space` (half of shared memory and of the container's memory limit).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import Placement, Shard
from elasticrun.checkpoint.memory.commit import NodeLayout
from elasticrun.checkpoint.memory.space import dir_bytes, memory_cap
from elasticrun.errors import CheckpointError
from elasticrun.job import env as env_names
from elasticrun.sizes import format_size


class SnapshotUnavailable(CheckpointError):
    """Memory snapshots cannot run in this job as it is (no memory tier, ranks on several nodes,
    too little memory): raised alike on every rank, and again at every try."""


class SnapshotMemoryError(SnapshotUnavailable):
    """The memory tier cannot hold the snapshots (shared memory too small, or over the cap)."""


def plan_memory(state_dict: Mapping[str, Any], placements: Optional[Mapping[str, Placement]], comm: Comm,
                base: Optional[str], generations: int) -> Tuple[int, NodeLayout]:
    """Collective: the bytes of one generation and which ranks share a node (a snapshot directory);
    raises on every rank alike when a rank has no memory tier or when ``generations`` of a node's
    share do not fit in its free space or the cap.

    A node holds, per generation, the parts its ranks write (their shards, and their share of
    the replicated tensors) plus, when there are several nodes, its ring predecessor's parts
    (the replica); that is checked against the node's free shared memory and the cap."""
    everyone = comm.all_gather(_measure(state_dict, placements, base))
    return fit_generations(everyone, comm.rank, comm.world_size, generations)


def _measure(state_dict: Mapping[str, Any], placements: Optional[Mapping[str, Placement]],
             base: Optional[str]) -> Dict[str, Any]:
    """This rank's record for :func:`fit_generations`: its snapshot directory, bytes replicated and
    sharded, the tier's free and used space and cap, and what went wrong (never raised)."""
    from elasticrun.checkpoint.tree import flatten

    error: Optional[str] = None
    rep = shard = 0
    free = used = cap = -1
    cap_from = cap_error = ""
    if base is None:
        missing = f"no memory tier: {env_names.SNAPSHOT_DIR} is not set (run under elasticrun on Linux, or pass base=)"
    else:
        missing = ""
    try:
        tensors, _ = flatten(state_dict)
        sharded = {k for k, p in (placements or {}).items() if isinstance(p, Shard)}
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            if name in sharded:
                shard += n
            else:
                rep += n
        if base is not None:
            st = os.statvfs(base)
            free, used = st.f_bavail * st.f_frsize, dir_bytes(base)
            cap, cap_from = memory_cap(base)
    except ValueError as err:  # the cap is not a size
        cap_error = f"{env_names.SNAPSHOT_MEMORY}: {err}"
    except Exception as err:  # noqa: BLE001 - reported collectively below
        error = f"cannot size the snapshot: {err}"
    return {"dir": os.path.realpath(base or "."), "rep": rep, "shard": shard, "free": free, "used": used,
            "cap": cap, "cap_from": cap_from, "cap_error": cap_error, "error": error, "missing": missing}


def fit_generations(everyone: Sequence[Mapping[str, Any]], rank: int, world_size: int,
                    generations: int) -> Tuple[int, NodeLayout]:
    """From every rank's gathered record (see :func:`_measure`): the bytes of one generation and the
    node layout, or the refusal every rank raises alike (a rank's problem, or a node over its cap
    or its free space)."""
    _raise_reported(everyone, world_size)
    layout = NodeLayout.from_dirs([g["dir"] for g in everyone], rank)
    gen = everyone[0]["rep"] + sum(g["shard"] for g in everyone)
    world = len(everyone)
    parts = [everyone[0]["rep"] * len(ranks) // world + sum(everyone[r]["shard"] for r in ranks)
             for ranks in layout.nodes]
    several = len(layout.nodes) > 1
    for i, ranks in enumerate(layout.nodes):
        per_gen = parts[i] + (parts[layout.predecessor(i)] if several else 0)
        need = per_gen * generations
        what = (f"{generations} generations of {format_size(per_gen)}" if not several else
                f"{generations} generations of {format_size(per_gen)}: its parts and a peer's replica")
        where = f" on node {i}" if several else ""
        g = everyone[ranks[0]]
        if need > g["cap"]:
            how = ("raise the cap" if g["cap_from"] == env_names.SNAPSHOT_MEMORY else
                   f"raise it with --snapshot-memory ({env_names.SNAPSHOT_MEMORY})")
            raise SnapshotMemoryError(
                f"memory snapshots need {format_size(need)}{where} ({what}) but {g['cap_from']} caps them at "
                f"{format_size(g['cap'])}: {how} or snapshot less state"
            )
        room = g["free"] + g["used"]
        if need > room:
            raise SnapshotMemoryError(
                f"memory snapshots need {format_size(need)} of shared memory{where} ({what}) but "
                f"{os.path.dirname(g['dir'])} has {format_size(room)} for them: enlarge /dev/shm "
                "(e.g. docker --shm-size) or snapshot less state"
            )
    return gen, layout


def _raise_reported(everyone: Sequence[Mapping[str, Any]], world_size: int) -> None:
    """Raise the first problem a rank reported: no memory tier, then a bad cap, then any other."""
    for r, g in enumerate(everyone):
        if g["missing"]:
            raise SnapshotUnavailable(g["missing"] if world_size == 1 else f"rank {r}: {g['missing']}")
    for g in everyone:
        if g["cap_error"]:
            raise SnapshotMemoryError(g["cap_error"])
    for r, g in enumerate(everyone):
        if g["error"]:
            raise CheckpointError(f"rank {r}: {g['error']}")


__all__ = ["SnapshotMemoryError", "SnapshotUnavailable", "fit_generations", "plan_memory"]
