"""A worker process for the checkpoint tests under real gloo process groups.

Usage: python ckpt_dist_worker.py SCENARIO RANK WORLD INIT_FILE ROOT
Exits 0 on success; prints one line and exits 1 when an assertion fails.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors import safe_open  # noqa: E402

import elasticrun.checkpoint.plan as plan  # noqa: E402
from elasticrun.checkpoint import AsyncCheckpointer, Shard, list_checkpoints, load, save  # noqa: E402
from elasticrun.checkpoint.state import TrainingState  # noqa: E402

W_ROWS = [1, 2, 3, 4]  # uneven Shard(0) slices held by ranks 0..3
E_COLS = [2, 2, 2, 1]  # uneven Shard(1) slices


def global_tensors() -> dict:
    g = torch.Generator().manual_seed(1234)
    return {
        "W": torch.randn(sum(W_ROWS), 6, generator=g),
        "E": torch.randn(3, sum(E_COLS), generator=g).to(torch.bfloat16),
        "R": torch.randn(1100, 1000, generator=g),  # 4.4 MB: replicated and split across ranks
        "bias": torch.randn(7, generator=g).to(torch.float16),
        "count": torch.tensor(42, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "mask": torch.rand(5, 5, generator=g) > 0.5,
    }


def local_state(rank: int, world: int) -> dict:
    g = global_tensors()
    if world != 4:  # any world: shard W and E evenly
        w, e = torch.tensor_split(g["W"], world)[rank].clone(), torch.tensor_split(g["E"], world, 1)[rank]
        return {"model": {"W": w, "E": e, "R": g["R"], "bias": g["bias"]}, "extra": {"count": g["count"]}}
    w0 = sum(W_ROWS[:rank])
    e0 = sum(E_COLS[:rank])
    return {
        "model": {
            "W": g["W"][w0:w0 + W_ROWS[rank]].clone(),
            "E": g["E"][:, e0:e0 + E_COLS[rank]],  # a non-contiguous view
            "R": g["R"],
            "bias": g["bias"],
        },
        "extra": {"count": g["count"], "empty": g["empty"], "mask": g["mask"], "note": "hello", "lr": [0.1, 0.2]},
    }


PLACEMENTS = {"model.W": Shard(0), "model.E": Shard(1)}


def check_loaded(sd: dict, rank: int, world: int) -> None:
    g = global_tensors()
    expect_w = torch.tensor_split(g["W"], world, dim=0)[rank]
    expect_e = torch.tensor_split(g["E"], world, dim=1)[rank]
    assert torch.equal(sd["model"]["W"], expect_w), f"W mismatch at rank {rank}/{world}"
    assert sd["model"]["E"].dtype == torch.bfloat16 and torch.equal(sd["model"]["E"], expect_e), "E mismatch"
    assert torch.equal(sd["model"]["R"], g["R"]), "R mismatch"
    assert torch.equal(sd["model"]["bias"], g["bias"]) and sd["model"]["bias"].dtype == torch.float16
    assert sd["extra"]["count"].shape == () and int(sd["extra"]["count"]) == 42
    assert sd["extra"]["empty"].shape == (0, 3)
    assert torch.equal(sd["extra"]["mask"], g["mask"])
    assert sd["extra"]["note"] == "hello" and sd["extra"]["lr"] == [0.1, 0.2]


def scenario_reshard(rank: int, world: int, root: str, parts: bool = False) -> None:
    ts = TrainingState(step=100, epoch=2, world_size=world)
    name = save(local_state(rank, world), root, training_state=ts, placements=PLACEMENTS,
                io_threads=rank + 1 if parts else 1)
    assert name == "step-00000100", name
    if rank == 0:
        files = sorted(f for f in os.listdir(os.path.join(root, name)) if f.endswith(".safetensors"))
        sizes = [os.path.getsize(os.path.join(root, name, f)) for f in files]
        if parts:  # rank r wrote up to r + 1 files in parallel, each a plain safetensors file
            per_rank = [sum(f.startswith(f"shard-{r:05d}-") for f in files) for r in range(world)]
            assert per_rank[0] == 1 and per_rank[3] >= 3 and len(files) > world, files
            for f in files:
                with safe_open(os.path.join(root, name, f), "pt") as st:
                    assert st.keys(), f
        else:  # every rank wrote ~1/4 of the replicated bytes: shard files of similar size
            assert len(sizes) == 4 and max(sizes) < 1.5 * min(sizes), sizes
    # Same world size, then 3, 2 and 1 ranks: real subgroups of the same processes.
    for sub in (4, 3, 2, 1):
        group = dist.new_group(list(range(sub)), backend="gloo")
        if rank < sub:
            res = load(root, "latest", process_group=group)
            assert res.world_size == 4 and res.training_state.step == 100
            check_loaded(res.state_dict, rank, sub)
            # In place, into preallocated tensors of this rank's new shape.
            g = global_tensors()
            target = {"model": {"W": torch.zeros_like(torch.tensor_split(g["W"], sub, 0)[rank]),
                                "R": torch.zeros(1100, 1000)}}
            ident = target["model"]["R"]
            load(root, name, state_dict=target, process_group=group)
            assert target["model"]["R"] is ident and torch.equal(ident, g["R"])
            assert torch.equal(target["model"]["W"], torch.tensor_split(g["W"], sub, 0)[rank])
        dist.barrier()


def scenario_reshard_parts(rank: int, world: int, root: str) -> None:
    plan.MIN_PART_BYTES = 1 << 18  # so these small ranks already write several files each
    scenario_reshard(rank, world, root, parts=True)


def scenario_async(rank: int, world: int, root: str) -> None:
    ckpt = AsyncCheckpointer()
    state = local_state(rank, world)
    for step in range(1, 5):
        state["model"]["bias"] = torch.full((7,), float(step), dtype=torch.float16)
        ckpt.save(state, root, training_state=TrainingState(step=step), placements=PLACEMENTS, keep_last=2)
        state["model"]["bias"].fill_(-1)  # mutating after the snapshot must not leak into the checkpoint
        dist.all_reduce(torch.ones(1))  # training collectives meanwhile, on the default group
    ckpt.close()
    dist.barrier()
    names = [i.name for i in list_checkpoints(root)]
    assert names == ["step-00000003", "step-00000004"], names
    res = load(root)
    assert res.name == "step-00000004" and torch.equal(res.state_dict["model"]["bias"], torch.full((7,), 4.0).half())


def scenario_crash(rank: int, world: int, root: str) -> None:
    save(local_state(rank, world), root, "good", placements=PLACEMENTS)
    os.environ["ELASTICRUN_CKPT_CRASH_AT"] = os.environ["CKPT_TEST_CRASH_AT"]  # kills one rank of this save
    save(local_state(rank, world), root, "doomed", placements=PLACEMENTS)


def main() -> None:
    scenario, rank, world, init_file, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        globals()[f"scenario_{scenario}"](rank, world, root)
    except AssertionError as err:
        print(f"rank {rank}: assertion failed: {err}\n{traceback.format_exc()}", flush=True)
        sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
