"""A memory restore never loads bytes that changed in shared memory after the commit: the local
copy is hashed first; a bad one comes from the peer holding its replica, else the restore falls
back to the next checkpoint (disk). Real files, real gloo processes for the two-node case."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from elasticrun.checkpoint import Snapshotter, list_checkpoints, save
from elasticrun.checkpoint.format import CheckpointMeta
from elasticrun.job.shm import GENERATIONS
from elasticrun.train import load_latest

from helpers.ckpt import node_results, run_nodes

NAN = struct.pack("<f", float("nan"))


def _spoil(shard: Path) -> None:
    """Overwrite the last float of a shard file's data in place with a NaN (same size: only the
    checksum can tell), as a stray write into /dev/shm would."""
    with open(shard, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(NAN)


def _shards(gen: Path) -> list:
    return sorted(p for p in gen.iterdir() if p.name.endswith(".safetensors"))


def test_a_changed_local_generation_is_not_loaded_and_disk_is_next(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    base, disk = tmp_path / "shm", str(tmp_path / "disk")
    base.mkdir()
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(base))
    save({"w": torch.full((256,), 1.0)}, disk, training_state={"step": 1})
    Snapshotter().snapshot({"w": torch.full((256,), 2.0)}, training_state={"step": 2})
    gen = next(i for i in list_checkpoints(str(base / GENERATIONS)) if i.status == "complete")
    _spoil(_shards(base / GENERATIONS / gen.name)[0])
    target = {"w": torch.zeros(256)}
    ckpt = load_latest(disk, state_dict=target)
    assert (ckpt.tier, ckpt.training_state.step) == ("disk", 1), "the changed memory generation was loaded"
    assert torch.equal(target["w"], torch.full((256,), 1.0)) and not torch.isnan(target["w"]).any()
    # No later restore tries it again.
    assert load_latest(disk).tier == "disk"


WORKER = r"""
import json, os, sys
import torch, torch.distributed as dist
from elasticrun.checkpoint import Shard, Snapshotter
from elasticrun.train import load_latest

phase, disk = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pl = {"w": Shard(0)}
full = torch.arange(64, dtype=torch.float32).reshape(32, 2)
if phase == "save":
    snaps = Snapshotter()
    snaps.snapshot({"w": torch.tensor_split(full, world)[rank].clone()}, training_state={"step": 5}, placements=pl)
    snaps.wait()
    dist.barrier()
else:
    target = {"w": torch.zeros_like(torch.tensor_split(full, world)[rank])}
    ck = load_latest(disk, state_dict=target, placements=pl)
    ok = torch.equal(target["w"], torch.tensor_split(full, world)[rank])
    print("RESULT " + json.dumps({"rank": rank, "tier": ck.tier, "step": ck.training_state.step, "ok": ok}), flush=True)
    dist.barrier()
dist.destroy_process_group()
"""


def test_a_changed_part_is_fetched_from_the_replica_on_the_next_node(tmp_path: Path) -> None:
    disk, n0, n1 = tmp_path / "disk", tmp_path / "node0", tmp_path / "node1"
    for d in (n0, n1):
        d.mkdir()
    saved = run_nodes(WORKER, ["save", str(disk)], [n0, n1])
    assert all(o.returncode == 0 for o in saved), [o.stdout[-2000:] for o in saved]
    (gen,) = [p for p in (n0 / GENERATIONS).iterdir() if (p / "metadata.json").exists()]
    meta = CheckpointMeta.loads((gen / "metadata.json").read_bytes(), str(gen))
    mine = [gen / n for n, e in meta.files.items() if e.rank == 0]
    assert mine and (n1 / "replicas" / gen.name / mine[0].name).exists(), "node 1 holds node 0's replica"
    _spoil(mine[0])
    outs = run_nodes(WORKER, ["load", str(disk)], [n0, n1])
    res = node_results(outs)
    # Both ranks restored the memory step with the right values: node 0's part came from node 1's replica.
    assert all((r["tier"], r["step"], r["ok"]) == ("memory", 5, True) for r in res), res
    assert "fails its checksum" in outs[0].stdout, outs[0].stdout[-3000:]
