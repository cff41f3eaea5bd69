#!/usr/bin/env python
"""The training loops bench_elastic.py measures besides examples/train.py: ``elastic_worker.py MODE OUT_DIR``.

``bench``    one all-reduce and a 0.1 s sleep per step; rank 0 keeps the next step in OUT_DIR/progress.json, so a
             restarted job resumes where it stopped. Only torch.distributed and ``env://``: any launcher runs it.
``inplace``  the ``bench`` loop with elasticrun.train.InPlace (a small model and optimizer registered): a join,
             a graceful leave or a peer's crash (``recover``) re-forms the survivors in place under elasticrun;
             elsewhere it restarts.
``plain``    a tight all-reduce loop that never polls and handles no signal, from step 0 each time; every rank
             prints ``BOOT`` when it starts and ``PG`` once its process group is up.

``bench`` and ``inplace`` write their pid to OUT_DIR/pid-<RANK> as they start (the ``crash`` scenario kills one).
Rank 0 prints ``STEP <n> WORLD <w> TIME <unix time>`` (``plain``: at most 20 a second); ``w`` comes from an
all-reduce to which every rank adds 1, so a line proves that ``w`` processes took part in that step.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def world() -> int:
    """The number of ranks that took part in one all-reduce."""
    x = torch.ones(1)
    dist.all_reduce(x)
    return int(x.item())


def note_pid(out_dir: str) -> None:
    """OUT_DIR/pid-<RANK>: this worker's pid (the launcher's RANK)."""
    with open(os.path.join(out_dir, f"pid-{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))


def bench(out_dir: str) -> None:
    note_pid(out_dir)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = os.path.join(out_dir, "progress.json")
    start = torch.zeros(1)
    if rank == 0 and os.path.exists(progress):
        with open(progress) as f:
            start += json.load(f)["next_step"]
    dist.broadcast(start, 0)
    step = int(start.item())
    while True:
        w = world()
        if rank == 0:
            print(f"STEP {step} WORLD {w} TIME {time.time():.3f}", flush=True)
            with open(f"{progress}.tmp", "w") as f:
                json.dump({"next_step": step + 1}, f)
            os.replace(f"{progress}.tmp", progress)
        step += 1
        time.sleep(0.1)


def inplace(out_dir: str) -> None:
    import elasticrun.train as et

    note_pid(out_dir)
    ctx = et.init()
    model = torch.nn.Linear(256, 256)
    reform = et.InPlace(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    while True:
        try:
            w = world()
        except RuntimeError as err:  # a peer crashed: re-form in place (or re-raise: the restart path)
            if reform.recover(err) is et.Reform.STOP:
                break
            continue
        if ctx.is_rank0:
            print(f"STEP {reform.step} WORLD {w} TIME {time.time():.3f}", flush=True)
        reform.step += 1
        time.sleep(0.1)
        if reform.check() is et.Reform.STOP:
            break
    ctx.close()


def plain() -> None:
    print(f"BOOT rank {os.environ.get('RANK')} {time.time():.3f}", flush=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"PG rank {rank} world {dist.get_world_size()} {time.time():.3f}", flush=True)
    x = torch.ones(1 << 16)
    step, last = 0, 0.0
    while True:
        x.fill_(1.0)
        dist.all_reduce(x)
        w, now = world(), time.time()
        if rank == 0 and now - last >= 0.05:
            print(f"STEP {step} WORLD {w} TIME {now:.3f}", flush=True)
            last = now
        step += 1


if __name__ == "__main__":
    modes = {"bench": lambda: bench(sys.argv[2]), "inplace": lambda: inplace(sys.argv[2]), "plain": plain}
    if len(sys.argv) < 2 or sys.argv[1] not in modes or (sys.argv[1] != "plain" and len(sys.argv) < 3):
        sys.exit("usage: elastic_worker.py bench|inplace|plain [OUT_DIR]   (under a launcher)")
    modes[sys.argv[1]]()
