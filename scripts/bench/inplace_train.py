#!/usr/bin/env python
"""The ``inplace`` client of ``scripts/bench/bench_elastic.py``: ``elastic_train.py``'s loop with
:class:`elasticrun.train.InPlace` (a small model and optimizer registered), so a join or a graceful
leave re-forms the survivors in place; under ``--no-inplace`` or torchrun it restarts as usual.

usage: inplace_train.py OUT_DIR [TOTAL_STEPS] [STEP_SLEEP]

Rank 0 prints ``STEP <n> WORLD <w> TIME <unix time>`` after each step (``w`` from an all-reduce).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import elasticrun.train as et


def main() -> None:
    """Train until TOTAL_STEPS, re-forming in place when the agents say so."""
    total = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    step_sleep = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
    ctx = et.init()
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reform = et.InPlace(ctx, model=model, optimizer=opt)
    while reform.step < total:
        x = torch.ones(1)
        dist.all_reduce(x)
        if ctx.is_rank0:
            print(f"STEP {reform.step} WORLD {int(x.item())} TIME {time.time():.3f}", flush=True)
        reform.step += 1
        time.sleep(step_sleep)
        if reform.check() is et.Reform.STOP:
            break
    ctx.close()


if __name__ == "__main__":
    main()
