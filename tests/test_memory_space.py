"""The memory tier's space rule (issue 18 d) and which files a restore needs (18 b).

The container memory limit is read from a fake filesystem root (cgroup v2 and v1 layouts);
the default cap is half of /dev/shm and of that limit; ``--snapshot-memory`` overrides it;
a snapshot over the default cap is refused with a message that says how to raise it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elasticrun.checkpoint.memory.space import cgroup_memory_limit, default_cap, memory_cap

GiB = 1 << 30


def _root(tmp_path: Path, cgroup: str, files: dict) -> str:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        p = tmp_path / "sys" / "fs" / "cgroup" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
    return str(tmp_path)


@pytest.mark.parametrize("cgroup, files, expected", [
    ("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/memory.max": str(8 * GiB)}, 8 * GiB),  # v2, own cgroup
    ("0::/\n", {"memory.max": str(4 * GiB)}, 4 * GiB),  # v2 in a cgroup namespace
    ("0::/\n", {"memory.max": "max"}, None),  # v2, no limit
    ("12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
     {"memory/docker/abc/memory.limit_in_bytes": str(2 * GiB)}, 2 * GiB),  # v1
    ("12:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),  # v1, no limit
    ("", {}, None),  # no cgroup at all
])
def test_the_container_memory_limit_is_read_from_cgroup_v2_and_v1(tmp_path: Path, cgroup, files, expected) -> None:
    assert cgroup_memory_limit(_root(tmp_path, cgroup, files)) == expected


def test_the_default_cap_leaves_headroom_and_respects_the_container_limit(tmp_path: Path, monkeypatch) -> None:
    assert default_cap(64 * GiB, None) == 32 * GiB
    assert default_cap(64 * GiB, 16 * GiB) == 8 * GiB  # a 16 GiB pod: snapshots may take 8 GiB, not 32
    monkeypatch.delenv("ELASTICRUN_SNAPSHOT_MEMORY", raising=False)
    root = _root(tmp_path / "root", "0::/\n", {"memory.max": str(2 * GiB)})
    cap, label = memory_cap(str(tmp_path), root)
    assert cap <= GiB and "default cap" in label
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_MEMORY", "3GiB")  # the option wins
    assert memory_cap(str(tmp_path), root) == (3 * GiB, "ELASTICRUN_SNAPSHOT_MEMORY")


def test_a_snapshot_over_the_default_cap_is_refused_with_how_to_raise_it(tmp_path: Path, monkeypatch) -> None:
    from elasticrun.checkpoint.comm import Comm
    from elasticrun.checkpoint.memory import SnapshotMemoryError, space
    from elasticrun.checkpoint.memory.budget import plan_memory

    monkeypatch.delenv("ELASTICRUN_SNAPSHOT_MEMORY", raising=False)
    monkeypatch.setattr(space, "cgroup_memory_limit", lambda root="/": 16 << 10)  # a 16 KiB "container"
    with pytest.raises(SnapshotMemoryError, match=r"the default cap \(half of shared memory and of the container's "
                       r"memory limit\) caps them at 8\.0 KiB: raise it with --snapshot-memory"):
        plan_memory({"w": torch.zeros(1024)}, None, Comm(None), str(tmp_path), 3)


def test_a_restore_needs_only_the_files_that_overlap_its_ranks_parts() -> None:
    from types import SimpleNamespace

    from elasticrun.checkpoint.format import Chunk, Replicate, Shard, TensorEntry
    from elasticrun.checkpoint.memory.fetch import files_needed

    def chunk(f: str, lo: int, n: int) -> Chunk:
        return Chunk(file=f, key="w", offsets=(lo, 0), shape=(n, 2))

    w = TensorEntry(name="w", dtype="F32", shape=(8, 2), placement=Shard(0),
                    chunks=(chunk("r0.safetensors", 0, 4), chunk("r1.safetensors", 4, 4)))
    meta: Any = SimpleNamespace(tensors={"w": w})  # all that files_needed reads
    assert files_needed(meta, None, {}, 0, 2) == {"r0.safetensors"}  # same size: its own part only
    assert files_needed(meta, None, {}, 1, 4) == {"r0.safetensors"}  # rows 2-3
    assert files_needed(meta, None, {}, 1, 3) == {"r0.safetensors", "r1.safetensors"}  # rows 3-5
    assert files_needed(meta, None, {"w": Replicate()}, 0, 2) == {"r0.safetensors", "r1.safetensors"}
    assert files_needed(meta, ["other"], {}, 0, 2) == set()
