"""The memory tier when things fail, with real gloo processes and real files (issue 18).

Two "nodes" (separate snapshot directories), one rank each, snapshot a sharded state
(steps 2, 3, 4; step 1 on disk). Then, in order:

- replica receipts (run by hand on a private group, chunks of 16 bytes): node 1 cannot store
  step 2's replica (ENOSPC on write): the transfer is drained, no temporary directory is left
  and step 3 replicates in step; node 0's step-4 part and its metadata are altered
  consistently: node 1 rejects it against its OWN copy of the metadata;
- a same-size restart reads only its own parts: nothing is fetched, and no loaded tensor
  maps a snapshot file (retention can free them);
- a restore of step 3 whose peer fetch fails with a RuntimeError on node 1 (a gloo error)
  falls back on BOTH ranks to step 2 (memory), and step 3 is recorded as failed;
- the restarted round never tries step 3 again; with node 1's cap too small for the files it
  must fetch, step 2 is refused too and both ranks load step 1 from disk.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from helpers.ckpt import node_results, run_nodes

pytestmark = pytest.mark.integration  # starts etcd or processes

REPO = Path(__file__).resolve().parent.parent

WORKER = r"""
import datetime, json, logging, os, sys
import torch, torch.distributed as dist
from elasticrun.checkpoint import Replicate, Shard, Snapshotter, save
from elasticrun.checkpoint.memory import replicas
from elasticrun.train import load_latest

logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
phase, disk = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank, world = dist.get_rank(), dist.get_world_size()
base = os.environ["ELASTICRUN_SNAPSHOT_DIR"]
pl = {"w": Shard(0), "v": Shard(0)}

def state(step):
    full = torch.arange(48, dtype=torch.float32).reshape(24, 2) + 1000 * step
    return {"w": torch.tensor_split(full, world)[rank].clone(), "v": torch.tensor_split(full + 1, world)[rank].clone()}

def gens():
    return sorted(n for n in os.listdir(os.path.join(base, "generations")) if not n.startswith("."))

def enospc(path, mode="r", *a, **k):
    if "w" in mode:
        raise OSError(28, "No space left on device")
    return open(path, mode, *a, **k)

if phase == "save":
    save(state(1), disk, training_state={"step": 1}, placements=pl)
    snaps = Snapshotter(replicate=False, keep=3)
    for step in (2, 3, 4):
        snaps.snapshot(state(step), training_state={"step": step}, placements=pl)
    layout, group, errors = snaps.layout, dist.new_group(backend="gloo"), {}
    replicas.CHUNK = 16  # many chunks per file: a receiver that stops early would put the pair out of step
    g2, g3, g4 = gens()
    if rank == 0:  # node 0's step-4 part altered, with metadata to match: only node 1's own copy tells
        from dataclasses import replace
        from elasticrun.checkpoint.checksum import Digest
        from elasticrun.checkpoint.format import CheckpointMeta
        d = os.path.join(base, "generations", g4)
        meta = CheckpointMeta.loads(open(os.path.join(d, "metadata.json"), "rb").read(), d)
        e = next(e for e in meta.files.values() if e.rank == 0)
        data = bytearray(open(os.path.join(d, e.name), "rb").read())
        data[-1] ^= 0xFF
        open(os.path.join(d, e.name), "wb").write(data)
        h = Digest(e.algo)
        h.update(bytes(data))
        meta.files[e.name] = replace(e, digest=h.hexdigest())
        open(os.path.join(d, "metadata.json"), "wb").write(meta.dumps())
    for tag, g in enumerate((g2, g3, g4), 1):
        if rank == 1 and g == g2:
            replicas.open = enospc  # node 1 cannot write step 2's replica
        try:
            replicas.replicate_generation(base, g, layout, group, 3, tag=tag)
        except Exception as err:
            errors[g] = str(err)
        finally:
            replicas.__dict__.pop("open", None)
    print("RESULT " + json.dumps({"rank": rank, "errors": errors, "gens": [g2, g3, g4]}), flush=True)
else:
    if phase == "fail-fetch" and rank == 1:
        from elasticrun.checkpoint.memory import fetch
        real = fetch.recv_file
        def broken(*a, **k):
            fetch.recv_file = real  # once: the older generation's fetch works
            real(*a, **k)
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        fetch.recv_file = broken
    load_pl = pl if phase == "same-size" else {"w": Replicate(), "v": Replicate()}  # all of it: fetch
    ck = load_latest(disk, placements=load_pl)
    maps = [ln for ln in open("/proc/self/maps") if base in ln]
    step = ck.training_state.step
    full = torch.arange(48, dtype=torch.float32).reshape(24, 2) + 1000 * step
    ok = torch.equal(ck.state_dict["w"], full if phase != "same-size" else torch.tensor_split(full, world)[rank])
    failed = os.path.join(base, "failed-restores")
    print("RESULT " + json.dumps({"rank": rank, "tier": ck.tier, "step": step, "ok": ok, "maps": maps,
                                  "failed": open(failed).read().split() if os.path.exists(failed) else []}),
          flush=True)
    dist.barrier()
    dist.destroy_process_group()
"""


def _run(phase: str, disk: Path, dirs: Sequence[Path], env_of: Sequence[Dict[str, str]] = ({}, {}),
         timeout: float = 120) -> List[subprocess.CompletedProcess]:
    return run_nodes(WORKER, [phase, str(disk)], dirs, timeout, env_of)


@pytest.mark.timeout(600)  # four two-process gloo runs; ~40 s alone, more on a loaded machine
def test_memory_restores_fall_back_together_and_replicas_stay_in_step(tmp_path: Path) -> None:
    disk, n0, n1 = tmp_path / "disk", tmp_path / "node0", tmp_path / "node1"
    for d in (n0, n1):
        d.mkdir()
    r0, r1 = node_results(_run("save", disk, [n0, n1]))
    g2, g3, g4 = r0["gens"]
    # (e) node 1's failed receipt: reported, drained (step 3 then replicates on both), nothing left behind.
    assert "cannot store" in r1["errors"].get(g2, ""), r1
    assert g3 not in r0["errors"] and g3 not in r1["errors"], (r0, r1)
    assert (n0 / "replicas" / g3 / "replica.json").exists() and (n1 / "replicas" / g3 / "replica.json").exists()
    assert not (n1 / "replicas" / g2).exists()
    assert [p.name for p in (n1 / "replicas").iterdir() if p.name.startswith(".")] == [], "no temp dir left"
    # (e) a self-consistent but altered part is rejected against the receiver's own metadata.
    assert "differs from this node's copy" in r1["errors"].get(g4, ""), r1
    assert not (n1 / "replicas" / g4).exists()
    for d in (n0, n1):  # forget step 4 and every replica: a node must now fetch what it lacks
        shutil.rmtree(d / "generations" / g4)
        shutil.rmtree(d / "replicas")

    # (b, f) same-size restart: each rank reads only its own parts: nothing fetched, nothing left mapped.
    outs = _run("same-size", disk, [n0, n1])
    for r in node_results(outs):
        assert (r["tier"], r["step"], r["ok"]) == ("memory", 3, True), r
        assert r["maps"] == [], r["maps"]
    assert all("0 file(s), 0 bytes fetched" in o.stdout for o in outs), [o.stdout[-2000:] for o in outs]

    # (a) the peer fetch of step 3 fails on node 1 only: both ranks fall back to step 2, step 3 is marked.
    for r in node_results(_run("fail-fetch", disk, [n0, n1])):
        assert (r["tier"], r["step"], r["ok"], r["failed"]) == ("memory", 2, True, [g3]), r

    # The restarted round never tries step 3 again; node 1's cap refuses step 2's fetch: disk step 1.
    outs = _run("restart", disk, [n0, n1], env_of=({}, {"ELASTICRUN_SNAPSHOT_MEMORY": "1KiB"}))
    for r in node_results(outs):
        assert (r["tier"], r["step"], r["ok"]) == ("disk", 1, True), r
    log = "\n".join(ln for ln in outs[0].stdout.splitlines() if ln.startswith("LOG "))
    assert g3 not in log and "over ELASTICRUN_SNAPSHOT_MEMORY (1.0 KiB)" in log, log[-3000:]
