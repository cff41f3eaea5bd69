"""The memory tier's budget decided from every rank's gathered record (no shared memory, no processes)."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from elasticrun.checkpoint.memory.budget import SnapshotMemoryError, SnapshotUnavailable, fit_generations
from elasticrun.errors import CheckpointError
from elasticrun.job import env as env_names


def _rec(d: str, rep: int = 0, shard: int = 0, free: int = 10**9, used: int = 0, cap: int = 10**9,
         **problems: Any) -> Dict[str, Any]:
    rec = {"dir": d, "rep": rep, "shard": shard, "free": free, "used": used, "cap": cap,
           "cap_from": "the default cap", "cap_error": "", "error": None, "missing": ""}
    rec.update(problems)
    return rec


def test_one_node_sums_the_shards_and_one_replicated_copy() -> None:
    everyone = [_rec("/shm/a", rep=100, shard=10), _rec("/shm/a", rep=100, shard=20)]
    gen, layout = fit_generations(everyone, rank=1, world_size=2, generations=3)
    assert gen == 130
    assert layout.nodes == [[0, 1]] and layout.rank == 1


def test_a_node_over_its_cap_is_refused_with_the_replica_counted() -> None:
    # Two nodes: each holds its part (50 + 10) and the peer's replica (50 + 20) per generation.
    everyone = [_rec("/shm/a", rep=100, shard=10, cap=1000), _rec("/shm/b", rep=100, shard=20, cap=259)]
    with pytest.raises(SnapshotMemoryError, match=r"on node 1 .*its parts and a peer's replica.*raise it with"):
        fit_generations(everyone, rank=0, world_size=2, generations=2)
    everyone[1]["cap"] = 260
    assert fit_generations(everyone, rank=0, world_size=2, generations=2)[0] == 130


def test_too_little_free_space_is_refused() -> None:
    with pytest.raises(SnapshotMemoryError, match="of shared memory .* enlarge /dev/shm"):
        fit_generations([_rec("/dev/shm/x", rep=100, free=150, used=49)], rank=0, world_size=1, generations=2)


def test_reported_problems_come_first_in_order() -> None:
    everyone = [_rec("/a", error="boom"), _rec("/a", cap_error=f"{env_names.SNAPSHOT_MEMORY}: bad"),
                _rec("/a", missing="no memory tier")]
    with pytest.raises(SnapshotUnavailable, match="^rank 2: no memory tier$"):
        fit_generations(everyone, rank=0, world_size=3, generations=1)
    everyone[2]["missing"] = ""
    with pytest.raises(SnapshotMemoryError, match="bad$"):
        fit_generations(everyone, rank=0, world_size=3, generations=1)
    everyone[1]["cap_error"] = ""
    with pytest.raises(CheckpointError, match="^rank 0: boom$"):
        fit_generations(everyone, rank=0, world_size=3, generations=1)
