"""Test worker: all-reduce, then write this rank's view of the world to OUT_DIR/rank<R>-r<restart>.json.

Options (env): FAIL_RANK_AT_RESTART="rank:restart" makes that rank raise once; ALWAYS_FAIL_RANK=r makes
rank r raise on every attempt; SLEEP_S keeps workers alive (in steps) before finishing.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

NAMES = [
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS", "ELASTICRUN_ROUND", "ELASTICRUN_PREV_WORLD_SIZE", "ELASTICRUN_RDZV_ENDPOINT",
    "ELASTICRUN_RDZV_ID", "ELASTICRUN_NODE_ID", "ELASTICRUN_RESCALE_TYPE", "ELASTICRUN_RESCALE_EVENT_FILE",
    "ELASTICRUN_BACKEND", "CUDA_VISIBLE_DEVICES",
]


@record
def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    fail = os.environ.get("FAIL_RANK_AT_RESTART")
    if fail and fail == f"{rank}:{restart}":
        raise RuntimeError(f"planned failure of rank {rank} at restart {restart}")
    if os.environ.get("ALWAYS_FAIL_RANK") == str(rank):
        raise ValueError(f"rank {rank} always fails")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    ranks = [None] * world
    dist.all_gather_object(ranks, {"rank": rank, "pid": os.getpid()})
    steps = int(float(os.environ.get("SLEEP_S", "0")) / 0.1)
    for _ in range(steps):
        time.sleep(0.1)
    record_ = {n: os.environ.get(n) for n in NAMES}
    record_.update(
        sum=t.item(),
        expected_sum=world * (world - 1) / 2,
        torchelastic=dist.is_torchelastic_launched(),
        pid=os.getpid(),
        gathered=ranks,
        prefixed={k: v for k, v in os.environ.items() if k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))},
    )
    path = os.path.join(out_dir, f"rank{rank}-r{restart}-round{os.environ['ELASTICRUN_ROUND']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record_, f)
    os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
