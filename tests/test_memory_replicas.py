"""Memory snapshots across "nodes" (separate snapshot directories) with real gloo processes.

2 nodes (2 ranks + 1 rank) snapshot a sharded state: each node holds its own parts and, after
the replication, its ring neighbour's parts; a generation torn by a rank SIGKILLed
mid-snapshot is never loaded; with one node's memory gone, the job restores at the memory
step from the survivor's parts and replica, with a newcomer node that fetches every file
from its peer's memory — at another world size (2) and at the same world size (3).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Sequence

import pytest

from elasticrun.checkpoint.format import CheckpointMeta

from helpers.ckpt import node_results, run_nodes

pytestmark = pytest.mark.integration  # starts etcd or processes

REPO = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, os, sys
import torch, torch.distributed as dist
from elasticrun.checkpoint import CheckpointError, Shard, Snapshotter, save
from elasticrun.train import load_latest

phase, disk = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pl = {"w": Shard(0)}

def full(step):
    return torch.arange(24, dtype=torch.float32).reshape(12, 2) + 1000 * step

def state(step):
    return {"w": torch.tensor_split(full(step), world)[rank].clone(), "b": torch.full((5,), float(step))}

if phase == "save":
    # The background path (the example's agent test runs the other); every 2nd generation to disk.
    snaps = Snapshotter(async_snapshots=True, persist_to=sys.argv[3], persist_every=2)
    save(state(1), disk, training_state={"step": 1}, placements=pl)
    for step in (2, 3):
        snaps.snapshot(state(step), training_state={"step": step}, placements=pl)
    snaps.wait()
    assert not snaps._replicator.errors, snaps._replicator.errors
    dist.barrier()
    os.environ["ELASTICRUN_CKPT_CRASH_AT"] = "after-shards:2"  # rank 2 dies mid-snapshot: step 4 is torn
    try:
        snaps.snapshot(state(4), training_state={"step": 4}, placements=pl)
        snaps.wait()
    except CheckpointError as err:
        print("TORN", str(err)[:200], flush=True)
    os._exit(0)
else:
    ck = load_latest(disk, placements=pl)
    w_ok = torch.equal(ck.state_dict["w"], torch.tensor_split(full(ck.training_state.step), world)[rank])
    b_ok = torch.equal(ck.state_dict["b"], torch.full((5,), float(ck.training_state.step)))
    print("RESULT " + json.dumps({"rank": rank, "tier": ck.tier, "step": ck.training_state.step, "w": w_ok,
                                  "b": b_ok}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
"""


def _run(phase: str, disk: Path, dirs: Sequence[Path], timeout: float = 180) -> List[subprocess.CompletedProcess]:
    """One process per entry of ``dirs`` (its node's snapshot directory); ranks in order."""
    return run_nodes(WORKER, [phase, str(disk), str(disk) + "-persisted"], dirs, timeout)


def _committed(d: Path) -> List[str]:
    return sorted(p.name for p in d.iterdir() if (p / "metadata.json").exists()) if d.is_dir() else []


def _meta(d: Path) -> CheckpointMeta:
    return CheckpointMeta.loads((d / "metadata.json").read_bytes(), str(d))


def test_replicas_survive_a_node_loss_and_restore_at_any_world_size(tmp_path: Path, monkeypatch) -> None:
    disk, n0, n1 = tmp_path / "disk", tmp_path / "node0", tmp_path / "node1"
    for d in (n0, n1):
        d.mkdir()
    outs = _run("save", disk, [n0, n0, n1])
    assert [o.returncode for o in outs] == [0, 0, -9], [o.stdout[-3000:] for o in outs]
    assert all("TORN" in o.stdout for o in outs[:2]), [o.stdout[-2000:] for o in outs]

    # Each node holds its own parts of steps 2 and 3, and its neighbour's parts as replicas.
    for me, mine_ranks, before in ((n0, {0, 1}, 1), (n1, {2}, 0)):
        gens = _committed(me / "generations")
        assert [g.split("-")[1] for g in gens] == ["00000002", "00000003"], gens
        for g in gens:
            meta = _meta(me / "generations" / g)
            here = {f.name for f in (me / "generations" / g).iterdir() if f.name.endswith(".safetensors")}
            assert here == {n for n, e in meta.files.items() if e.rank in mine_ranks}, (me, g, here)
            rep = me / "replicas" / g
            theirs = {f.name for f in rep.iterdir() if f.name.endswith(".safetensors")}
            assert theirs == set(meta.files) - here and theirs, (me, g, theirs)
            assert json.loads((rep / "replica.json").read_text())["from_node"] == before
        # The torn step-4 snapshot left at most a temporary directory, never a committed generation.
        assert not any("00000004" in g for g in gens + _committed(me / "replicas"))

    # The 2nd generation (step 3) was persisted to disk by both nodes' leaders: complete, verified.
    from elasticrun.checkpoint import list_checkpoints, verify

    persisted = tmp_path / "disk-persisted"
    infos = [i for i in list_checkpoints(str(persisted)) if i.status == "complete"]
    assert [(i.name.split("-")[1], i.meta.step) for i in infos] == [("00000003", 3)], (  # the workers' warnings say why
        infos, [o.stdout[-3000:] for o in outs])
    assert verify(str(persisted), infos[0].name).ok
    assert not [p.name for p in persisted.iterdir() if p.is_dir() and p.name.startswith(".")], "no temp dir left"

    # Node 1 is lost (its memory with it); a newcomer node 2 has nothing. World 2, then 3 (as saved):
    # the memory step, from node 0's parts + its replica of node 1, fetched by node 2, resharded.
    shutil.rmtree(n1)
    n2 = tmp_path / "node2"
    n2.mkdir()
    for dirs in ([n0, n2], [n0, n0, n2]):
        res = node_results(_run("load", disk, dirs))
        assert all((r["tier"], r["step"], r["w"], r["b"]) == ("memory", 3, True, True) for r in res), (dirs, res)
        assert not (n2 / "restore").exists() or not os.listdir(n2 / "restore"), "the fetched copy is released"

    # Without node 0's replica of node 1, step 3 is no longer complete anywhere: disk is next.
    from elasticrun.checkpoint.memory import Tier, candidates

    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(n0))
    assert candidates(str(disk))[0][0] is Tier.MEMORY
    for g in _committed(n0 / "replicas"):
        shutil.rmtree(n0 / "replicas" / g)
    assert [(t, n.split("-")[1]) for t, _r, n in candidates(str(disk))] == [(Tier.DISK, "00000001")]
