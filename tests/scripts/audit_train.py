"""An audited elastic training job (tests/test_e2e_train_audit.py runs it under real agents).

Built only on ``elasticrun.train``: ElasticDistributedSampler + a DataLoader, a fixed
global batch (``--global-batch-size`` from the launcher, gradient accumulation when the
world shrinks), a checkpoint every step with the sampler and RNG state, graceful stop.

Bitwise-reproducible gradients at any world size: every rank computes per-sample
gradients (float64, one sample at a time, so no batch-size-dependent kernel blocking),
the ranks all-gather them with their dataset indices, and every rank sums them in
ascending index order. The sum therefore has the same float rounding at world 1, 2 or 3.

Every process appends JSON lines to ``<out>/log-<node>-<pid>.jsonl``:

- ``{"event": "resume", "round", "world", "rank", "ckpt_step", ...}`` once at start
  (``ckpt_step`` 0 on a fresh start);
- ``{"event": "step", "step", "epoch", "indices", "rng", ...}`` after each optimizer step
  (``indices``: the samples this rank trained on, as delivered by the DataLoader);
- ``{"event": "saved", "step"}`` after each committed checkpoint.

While ``<out>/hold`` exists every rank waits after its step (until SIGTERM): the test
uses it to keep the job mid-epoch while a node joins. ``<out>/crash-at`` holding a step
number makes global rank 1 exit with code 1 right after training that step (before its
checkpoint), once (the file is renamed). Rank 0 writes the final parameters to
``<out>/params.pt`` and ``<step> <world>`` to ``<out>/finished``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import elasticrun.train as et
from elasticrun.checkpoint import save as ckpt_save


class Toy(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 1000)
        self.x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--dataset", type=int, default=96)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args()
    out = a.out
    ctx = et.init()
    world, rank, st = ctx.world_size, ctx.rank, ctx.state
    node = st.node_id or "local"
    logf = open(os.path.join(out, f"log-{node}-{os.getpid()}.jsonl"), "a", encoding="utf-8")

    def log(**rec: Any) -> None:
        rec.update(time=time.time(), round=st.round, world=world, rank=rank, node=node)
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

    torch.manual_seed(a.seed)  # the same initial model everywhere
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    params = list(model.parameters())
    optim = torch.optim.SGD(params, lr=a.lr, momentum=0.9)
    global_batch = et.default_global_batch() or a.micro * world
    accum = et.accumulation_steps(global_batch, a.micro, world)
    lr = et.scale_lr(a.lr, 1, world) if not et.default_global_batch() else a.lr
    data = Toy(a.dataset, a.seed)
    sampler = et.ElasticDistributedSampler(data, world, rank, seed=a.seed)
    et.seed_all(et.derive_seed(a.seed, 0, rank))  # per-rank streams (checked on replay)
    ckpt_dir = os.path.join(out, "ckpts")
    ckpt = et.load_latest(ckpt_dir, process_group=ctx.cpu_process_group, sampler=sampler)
    step = 0
    if ckpt is not None:
        model.load_state_dict(ckpt.state_dict["model"])
        optim.load_state_dict(ckpt.state_dict["optim"])
        step = ckpt.training_state.step
    for group in optim.param_groups:
        group["lr"] = lr
    log(event="resume", ckpt_step=step, lr=lr, accum=accum, global_batch=global_batch,
        redistribution=sampler.redistribution.value, strategy=et.default_strategy().value)
    loader = DataLoader(data, batch_size=a.micro, sampler=sampler, num_workers=a.num_workers,
                        generator=torch.Generator())  # its own generator: iter() must not draw from torch's
    requests = et.CheckpointRequests(ctx, every=1)
    crash_file = os.path.join(out, "crash-at")
    hold_file = os.path.join(out, "hold")
    try:
        for epoch in range(sampler.epoch, a.epochs):
            sampler.set_epoch(epoch)
            it = iter(loader)
            while not sampler.epoch_done:
                rows: List[torch.Tensor] = []
                idx: List[int] = []
                for _ in range(accum):
                    ids, xs, ys = next(it)
                    for i, x, y in zip(ids.tolist(), xs, ys):
                        model.zero_grad(set_to_none=True)
                        ((model(x.unsqueeze(0)) - y.unsqueeze(0)) ** 2).sum().backward()
                        rows.append(torch.cat([q.grad.reshape(-1) for q in params]))
                        idx.append(i)
                grad = ordered_sum(torch.stack(rows), torch.tensor(idx), ctx.cpu_process_group) / global_batch
                offset = 0
                for q in params:
                    q.grad = grad[offset:offset + q.numel()].view_as(q).clone()
                    offset += q.numel()
                optim.step()
                step += 1
                sampler.advance(len(idx))
                draws = [float(torch.rand(1)), random.random(), float(np.random.rand())]
                log(event="step", step=step, epoch=epoch, indices=idx, rng=draws)
                if a.step_sleep:
                    time.sleep(a.step_sleep)
                while os.path.exists(hold_file) and not ctx.should_stop:  # the test holds the job in place
                    time.sleep(0.05)
                if rank == 1 and os.path.exists(crash_file):
                    with open(crash_file) as f:
                        at = int(f.read().strip() or 0)
                    if step >= at:
                        os.replace(crash_file, crash_file + ".done")
                        log(event="crash", step=step)
                        os._exit(1)
                decision = requests.poll(step, stop=ctx.should_stop)
                save(model, optim, sampler, step, epoch, lr, global_batch, world, ckpt_dir, ctx, a.seed)
                log(event="saved", step=step)
                if decision.stop:
                    log(event="stopped", step=step)
                    return 143
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, "params.pt"))
            with open(os.path.join(out, "finished"), "w") as f:
                f.write(f"{step} {world}\n")
        log(event="done", step=step)
        return 0
    finally:
        requests.close()
        logf.close()
        ctx.close()


def ordered_sum(rows: torch.Tensor, idx: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of every rank's per-sample gradient rows, in ascending dataset index order."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        n = dist.get_world_size(group)
        all_rows = [torch.empty_like(rows) for _ in range(n)]
        all_idx = [torch.empty_like(idx) for _ in range(n)]
        dist.all_gather(all_rows, rows, group=group)
        dist.all_gather(all_idx, idx, group=group)
        rows, idx = torch.cat(all_rows), torch.cat(all_idx)
    total = torch.zeros(rows.shape[1], dtype=rows.dtype)
    for k in torch.argsort(idx).tolist():
        total += rows[k]
    return total


def save(model: nn.Module, optim: Any, sampler: Any, step: int, epoch: int, lr: float, global_batch: int,
         world: int, root: str, ctx: Any, seed: int) -> None:
    state: Dict[str, Any] = {"model": model.state_dict(), "optim": optim.state_dict(),
                             "sampler": sampler.state_dict(), "rng": et.capture_rng(seed, ctx.cpu_process_group)}
    ts = et.TrainingState(epoch=epoch, step=step, samples_consumed=sampler.samples_consumed, learning_rate=lr,
                          global_batch_size=global_batch, world_size=world)
    ckpt_save(state, root, training_state=ts, keep_last=3, process_group=ctx.cpu_process_group)


if __name__ == "__main__":
    sys.exit(main())
