"""Test worker for hang blame: gloo ranks all-reduce each step and report it with ``heartbeat``;
after step 5 of the first round, rank STUCK_RANK (default 1) stands in ``stuck_here`` for good while
the others wait for it in ``all_reduce``. Later rounds finish at once and print ``done rank=<RANK>``.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import elasticrun.train as et


def stuck_here() -> None:
    while True:
        time.sleep(0.1)


def train_step(step: int) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    et.heartbeat(step)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first_round = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    for step in range(10):
        if first_round and step == 5 and rank == int(os.environ.get("STUCK_RANK", "1")):
            stuck_here()
        train_step(step)
        time.sleep(0.1)
    dist.destroy_process_group()
    print(f"done rank={rank}", flush=True)


if __name__ == "__main__":
    main()
