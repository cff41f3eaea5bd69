#!/usr/bin/env python
"""Tiny elastic training loop for ``scripts/bench/bench_elastic.py``; runs under elasticrun and torchrun.

usage: elastic_train.py OUT_DIR [TOTAL_STEPS] [STEP_SLEEP]

Every step all-reduces one small tensor over gloo and sleeps ``STEP_SLEEP`` seconds (0.1 by
default). Rank 0 prints ``STEP <n> WORLD <w> TIME <unix time>`` (flushed) after each step and
saves the next step number to ``OUT_DIR/progress.json`` (atomic replace), so a restarted or
re-formed job resumes where it stopped. The world size is taken from the all-reduce result
(every rank adds 1), so a line proves that ``w`` processes really took part in that step.

Only ``torch.distributed`` and the standard ``env://`` variables are used, so the script is
launcher-agnostic. It imports nothing from elasticrun.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def read_step(progress: str) -> int:
    """The next step saved by an earlier attempt, or 0."""
    try:
        with open(progress) as f:
            return int(json.load(f)["next_step"])
    except (OSError, ValueError, KeyError):
        return 0


def save_step(progress: str, step: int) -> None:
    """Atomically record ``step`` as the next step to run."""
    tmp = f"{progress}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"next_step": step}, f)
    os.replace(tmp, progress)


def main() -> None:
    """Join the process group, agree on the start step, then train until TOTAL_STEPS."""
    out_dir = sys.argv[1]
    total = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    step_sleep = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = os.path.join(out_dir, "progress.json")
    start = torch.tensor([float(read_step(progress) if rank == 0 else 0)])
    dist.broadcast(start, 0)
    step = int(start.item())
    while step < total:
        x = torch.ones(1)
        dist.all_reduce(x)
        if rank == 0:
            print(f"STEP {step} WORLD {int(x.item())} TIME {time.time():.3f}", flush=True)
            save_step(progress, step + 1)
        step += 1
        time.sleep(step_sleep)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
