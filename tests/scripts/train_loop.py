"""Test worker: a tiny elastic training loop that survives rescales.

usage: train_loop.py OUT_DIR TOTAL_STEPS [STEP_SLEEP]
Every step all-reduces; rank 0 appends "step S world W round R" to OUT_DIR/steps.log and saves the
next step to OUT_DIR/progress.json (the "checkpoint"), so a restarted round resumes where it stopped.
Once OUT_DIR/end exists (a test has seen what it waited for), the job ends after the step in which rank 0
saw it, as after TOTAL_STEPS (the ranks agree on it in the step's all-reduce).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    out_dir, total = sys.argv[1], int(sys.argv[2])
    step_sleep = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rnd = os.environ["ELASTICRUN_ROUND"]
    pids = os.path.join(out_dir, "pids")
    os.makedirs(pids, exist_ok=True)
    with open(os.path.join(pids, f"{os.environ['ELASTICRUN_NODE_ID']}-{os.getpid()}"), "w") as f:
        f.write(rnd)
    progress = os.path.join(out_dir, "progress.json")
    step = 0
    if os.path.exists(progress):
        with open(progress) as f:
            step = json.load(f)["next_step"]
    t = torch.tensor([float(step)])
    dist.broadcast(t, 0)
    step = int(t.item())
    end = os.path.join(out_dir, "end")
    while step < total:
        x = torch.tensor([1.0, float(rank == 0 and os.path.exists(end))])
        dist.all_reduce(x)
        if rank == 0:
            with open(os.path.join(out_dir, "steps.log"), "a") as f:
                f.write(f"step {step} world {int(x[0].item())} round {rnd} time {time.time():.3f}\n")
            with open(progress + ".tmp", "w") as f:
                json.dump({"next_step": step + 1}, f)
            os.replace(progress + ".tmp", progress)
        step += 1
        if x[1].item() > 0:
            break
        time.sleep(step_sleep)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "finished"), "w") as f:
            f.write(f"{world}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
